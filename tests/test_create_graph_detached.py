"""create-graph-detached on a small model written here, not like torchmd-net: a cluster potential over
a dict batch whose pair distances go through a custom ``autograd.Function`` (its backward written by
hand, differentiable in eager) and whose forward returns forces from ``autograd.grad(...,
create_graph=self.training)``. ``torch.compile(model, backend="eager")`` (torch 2.13) traces the Function
into dynamo's ``autograd_function_apply`` with its backward under grad mode off, graph-breaks on the
``autograd.grad``, and the forces come back right but with no gradient path: nothing raises.

What reproduces it is the traced custom Function: the same model with plain ops, or with the Function's
caller kept out of dynamo (``torch.compiler.disable``), matches eager on the same path."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import gradprobe
from gradprobe.claims import audit


class PairDistance(torch.autograd.Function):
    """|x_j - x_i| for each pair, with its backward by hand (differentiable: plain ops on saved inputs)."""

    @staticmethod
    def forward(ctx, coords, pairs):  # type: ignore[no-untyped-def,override]
        d = coords[pairs[1]] - coords[pairs[0]]
        r = d.norm(dim=-1)
        ctx.save_for_backward(coords, pairs)
        return r

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def,override]
        coords, pairs = ctx.saved_tensors
        d = coords[pairs[1]] - coords[pairs[0]]
        u = d / d.norm(dim=-1, keepdim=True) * g.unsqueeze(-1)
        out = torch.zeros_like(coords).index_add(0, pairs[1], u).index_add(0, pairs[0], -u)
        return out, None


def distances(coords: torch.Tensor, pairs: torch.Tensor, custom: bool) -> torch.Tensor:
    if custom:
        return PairDistance.apply(coords, pairs)
    return (coords[pairs[1]] - coords[pairs[0]]).norm(dim=-1)


class Cluster(nn.Module):
    """Energy of a cluster from a radial basis of its pair distances; forces inside the forward."""

    def __init__(self, custom: bool = True, disabled: bool = False) -> None:
        super().__init__()
        self.custom = custom
        self.centers = nn.Parameter(torch.linspace(0.5, 2.5, 6, dtype=torch.float64))
        self.mix = nn.Sequential(
            nn.Linear(6, 8, dtype=torch.float64), nn.Tanh(), nn.Linear(8, 1, dtype=torch.float64)
        )
        self.pair_distances = torch.compiler.disable(distances) if disabled else distances

    def forward(self, coords: torch.Tensor, pairs: torch.Tensor) -> dict[str, torch.Tensor]:
        coords.requires_grad_(True)
        r = self.pair_distances(coords, pairs, self.custom)
        basis = torch.exp(-((r.unsqueeze(-1) - self.centers) ** 2))
        energy = self.mix(basis).sum()
        (grad,) = torch.autograd.grad(energy, coords, create_graph=self.training)
        return {"energy": energy, "forces": -grad}


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    n = 5
    pairs = torch.tensor([(i, j) for i in range(n) for j in range(n) if i != j]).T
    return {
        "coords": torch.rand(n, 3, generator=g, dtype=torch.float64) * 2,
        "pairs": pairs,
        "e_ref": torch.randn((), generator=g, dtype=torch.float64),
        "f_ref": torch.randn(n, 3, generator=g, dtype=torch.float64),
    }


def step(model: nn.Module, b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = model(b["coords"].clone(), b["pairs"])
    return {"energy": (out["energy"] - b["e_ref"]) ** 2, "forces": ((out["forces"] - b["f_ref"]) ** 2).mean()}


LINE = next(i for i, text in enumerate(inspect.getsourcelines(Cluster.forward)[0]) if "autograd.grad" in text)
GRAD_LINE = inspect.getsourcelines(Cluster.forward)[1] + LINE
APPLY_LINE = inspect.getsourcelines(distances)[1] + 2


def probed(model: nn.Module) -> gradprobe.FlowMap:
    torch.manual_seed(0)
    return gradprobe.probe(model.train(), step, batch(), variants="eager,compile_model:eager", progress=False)


@pytest.fixture(scope="module")
def detached() -> gradprobe.FlowMap:
    return probed(Cluster())


def test_forces_come_back_right_without_a_graph_and_the_call_is_named(detached: gradprobe.FlowMap) -> None:
    v = "compile_model:eager"
    assert detached.run(v, "forces only").error is not None
    assert detached.run(v, "forces only").error.type == "NoGradPath"  # type: ignore[union-attr]
    (f,) = [f for f in detached.findings if f.cause == "create-graph-detached"]
    assert f.severity == "error" and f.location["variant"] == v
    assert f.location["file"] == __file__ and f.location["line"] == GRAD_LINE
    assert "in eager the same call returns them with a graph" in f.message
    # The traced custom Function behind it, with the line that applied it; the fix is not tried here.
    assert f.evidence["traced_functions"][0]["applied_at"]["line"] == APPLY_LINE
    assert "torch.compiler.disable on distances" in f.fix and "(not tried)" in f.fix
    assert {tuple(r) for r in f.evidence["runs"]} == {(v, "forces only"), (v, "all")}


def test_the_recorder_leaves_the_compiled_path_as_it_is(detached: gradprobe.FlowMap) -> None:
    # The wrapper around autograd's engine is kept out of dynamo: only the model's own frames compile.
    runs = detached.evidence["dynamo"]["compile_model:eager"]["runs"]
    files = {c["file"] for w in runs.values() for c in w["compiles"]}
    assert files == {__file__}, files


def test_the_generic_findings_do_not_repeat_it(detached: gradprobe.FlowMap) -> None:
    causes = {f.cause for f in detached.findings if f.severity == "error"}
    assert causes == {"create-graph-detached"}, causes
    assert audit(detached) == []


@pytest.mark.parametrize("kind", ["plain ops", "Function kept out of dynamo"])
def test_without_a_traced_function_the_path_matches_and_nothing_is_named(kind: str) -> None:
    model = Cluster(custom=False) if kind == "plain ops" else Cluster(disabled=True)
    fm = probed(model)
    assert all(fm.run("compile_model:eager", s).error is None for s in fm.scenario_names)
    assert not any(fm.differences("compile_model:eager", s) for s in fm.scenario_names)
    assert not [f for f in fm.findings if f.severity == "error"], [f.cause for f in fm.findings]
