"""The gradients check (``gradcheck.py``): finite differences of each term's value against autograd.

It must stay quiet on healthy models of every kind the suite has (ReLU's exact zeros, dropout,
BatchNorm in training mode, float32 models checked on themselves), and see what no count can: a
custom ``autograd.Function`` whose backward is scaled by 0.9, and a cut that leaves every parameter
reached (``autograd.grad`` without ``create_graph`` on one of two derivative routes)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradprobe
from gradprobe import gradcheck
from gradprobe.zoo import reference_spec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from other_models import (
    encoder_step,
    make_encoder,
    make_mlp,
    make_small,
    mlp_step,
    small_step,
)


def statuses(fm: gradprobe.FlowMap) -> dict[tuple[str, str], str]:
    g = fm.checks["gradients"]
    return {(p, t): e["status"] for p, r in g["paths"].items() for t, e in r["terms"].items()}


def relu_net() -> tuple[nn.Module, Any]:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
    return model, torch.randn(64, 8)


def relu_step(m: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    y = m(x)
    return {"a": y[:, 0].pow(2).mean(), "b": y[:, 1].abs().mean()}


HEALTHY = {
    "mlp with BatchNorm and dropout, float32": (make_mlp, mlp_step),
    "functional model, float32": (make_small, small_step),
    "transformer layer with dropout, float32": (make_encoder, encoder_step),
    "ReLU net (exact zeros), float32": (relu_net, relu_step),
}


@pytest.mark.parametrize("name", list(HEALTHY))
@pytest.mark.parametrize("on_copy", [True, False], ids=["float64 copy", "own dtype"])
def test_no_false_alarm_on_healthy_models(name: str, on_copy: bool) -> None:
    make, step = HEALTHY[name]
    model, batch = make()
    if not on_copy:  # the model itself in its own dtype, as every non-reference path is checked
        terms = list(step(model, batch))
        weighted = gradprobe.build.VariantContext(model, step, "terms", terms, batch, {}).weighted()
        path = gradcheck.Path("eager", lambda w: weighted(model, batch, w), [
            (n, p) for n, p in model.named_parameters() if p.requires_grad], list(model.buffers()), "the model")  # fmt: skip
        result = gradcheck.gradients_check([path], terms, "terms", 0, 30.0)
        found = {t: e["status"] for t, e in result["paths"]["eager"]["terms"].items()}
    else:
        fm = gradprobe.probe(model, step, batch, checks=["gradients"], progress=False)
        assert fm.checks["gradients"]["paths"]["eager"]["on"] == "a float64 copy"
        found = {t: s for (_, t), s in statuses(fm).items()}
        assert not [f for f in fm.findings if f.cause == "gradient-mismatch"], fm.findings
    assert "disagrees" not in found.values(), found


def test_the_reference_potential_agrees_with_its_finite_differences() -> None:
    fm = gradprobe.probe(reference_spec(), checks=["gradients"], progress=False)
    assert set(statuses(fm).values()) == {"agrees"}
    g = fm.checks["gradients"]
    assert g["seconds"] <= g["budget_s"] and g["paths"]["eager"]["detectable"] == 1e-4


class ScaledSoftplus(torch.autograd.Function):
    """softplus whose backward is 0.9 of the derivative: every status stays right."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return torch.nn.functional.softplus(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 0.9 * grad * torch.sigmoid(x)


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 16)
        self.outer = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(ScaledSoftplus.apply(self.inner(x))).squeeze(-1)


def test_a_custom_function_whose_backward_is_scaled_is_found_and_asked_about() -> None:
    torch.manual_seed(0)
    model = Regressor()
    batch = (torch.randn(32, 4), torch.randn(32))
    fm = gradprobe.probe(
        model, lambda m, b: {"fit": (m(b[0]) - b[1]).pow(2).mean()}, batch, diagnose=True, progress=False
    )
    assert fm.checks["gradients"]["paths"]["eager"]["terms"]["fit"]["status"] == "disagrees"
    (f,) = [f for f in fm.findings if f.cause == "gradient-mismatch"]
    # A surrogate gradient may be meant: the tool asks (a warning), at the Function's call.
    assert f.severity == "warning" and "ScaledSoftplus.apply" in f.message
    assert "ScaledSoftplus.apply(self.inner(x))" in f.location["code"]
    assert set(f.evidence["parameters"]) == {"inner.weight", "inner.bias"}
    assert gradprobe.claims.audit(fm) == []
    declared = gradprobe.probe(
        model, lambda m, b: {"fit": (m(b[0]) - b[1]).pow(2).mean()}, batch, diagnose=True, progress=False,
        notes={"inner": "straight-through surrogate, meant"},
    )  # fmt: skip
    assert [f.severity for f in declared.findings if f.cause == "gradient-mismatch"] == ["info"]


class Oscillator(nn.Module):
    """Energy of (q, p); the step fits both derivatives. ``exact=False`` takes dE/dp without
    create_graph: every parameter is still reached through dE/dq, only the values are wrong."""

    def __init__(self, exact: bool) -> None:
        super().__init__()
        self.exact = exact
        self.net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, q: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.net(torch.stack([q, p], -1)).sum()
        (dq,) = torch.autograd.grad(e, q, create_graph=True)
        (dp,) = torch.autograd.grad(e, p, create_graph=self.exact, retain_graph=True)
        return dq, dp


@pytest.mark.parametrize("exact", [False, True])
def test_a_cut_that_leaves_every_parameter_reached(exact: bool) -> None:
    torch.manual_seed(1)
    model = Oscillator(exact).double()
    q, p = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)

    def step(m: Oscillator, b: Any) -> dict[str, torch.Tensor]:
        dq, dp = m(b[0].clone().requires_grad_(), b[1].clone().requires_grad_())
        return {"dynamics": (dq + b[0]).pow(2).mean() + (dp - b[1]).pow(2).mean()}

    fm = gradprobe.probe(model, step, (q, p), diagnose=True, progress=False)
    # Every parameter the derivatives can reach is reached, bug or not (the output bias is a constant).
    assert fm.count("eager", "dynamics only") == (3, 4)
    # The check's own line in the report: its cost, on what, its resolution, each term's verdict.
    out = gradprobe.render(fm)
    assert "gradients vs finite differences (" in out and "s budget):" in out, out
    assert "eager (on the model, float64, detects 0.0001 or more): dynamics " in out, out
    if exact:
        assert fm.errors() == [] and statuses(fm)[("eager", "dynamics")] == "agrees"
        assert "dynamics agrees" in out
        return
    (f,) = fm.errors()
    assert f.cause == "gradient-mismatch" and f.location["kind"] == "autograd_grad_no_create_graph"
    assert "create_graph=self.exact" in f.location["code"]
    assert "the gradient is off its finite differences along net." in f.message, f.message
    gap = fm.checks["gradients"]["paths"]["eager"]["terms"]["dynamics"]["rel_error"]
    assert f"dynamics off by {gap:.0%} along net." in out, out
    assert gradprobe.claims.audit(fm) == []
