"""Bisecting a path that declares no knobs: the force_eager stance, then backend overrides.

The path is a user's opaque compiled trainer (a plain ``run``), compiled with a custom backend whose
graph pass detaches one weight. Nothing about it is handed over: the bisector must find out that the
break is in compilation (right under ``force_eager``), that every standard backend is right, and
that the path's own backend is the culprit — and re-measure the fix it claims.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._dynamo.backends.debugging import aot_eager

import gradprobe
from gradprobe.variants import user_variant

BATCH = {"inp": torch.randn(16, 3), "tgt": torch.randn(16, 2)}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))


def _terms(model: nn.Module, b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    y = model(b["inp"])
    return {"mse": (y - b["tgt"]).pow(2).mean(), "l1": y.abs().mean()}


def _lossy(gm: torch.fx.GraphModule, example_inputs: list) -> object:  # type: ignore[type-arg]
    """aot_eager after a buggy pass that detaches the first layer's weight."""
    for node in list(gm.graph.nodes):
        if node.op == "placeholder" and "weight" in node.name and "_0_" in node.name:
            with gm.graph.inserting_after(node):
                cut = gm.graph.call_function(torch.detach, (node,))
            node.replace_all_uses_with(cut, delete_user_cb=lambda user, cut=cut: user is not cut)
    gm.recompile()
    return aot_eager(gm, example_inputs)


def _loss(model: nn.Module, b: dict[str, torch.Tensor], w: torch.Tensor):  # type: ignore[no-untyped-def]
    terms = _terms(model, b)
    return w[0] * terms["mse"] + w[1] * terms["l1"], terms


def _trainer(ctx):  # type: ignore[no-untyped-def]
    compiled = torch.compile(_loss, backend=_lossy)  # compiled while the path is built
    return lambda b, w: compiled(ctx.model, b, torch.stack([w["mse"], w["l1"]]))


def test_a_knobless_compiled_path_is_bisected_to_its_own_backend():
    fm = gradprobe.probe(_model(), lambda m, b: _terms(m, b), BATCH, variants=["eager", user_variant("mine", _trainer)],
                         diagnose=True)  # fmt: skip
    assert fm.count("mine", "mse only") == (3, 4)
    (b,) = fm.bisections
    assert [t["knob"] for t in b["trials"]] == ["stance", "backend", "backend", "backend"]
    assert all(t["ok"] for t in b["trials"])  # right under force_eager and under every override rung
    assert b["stage"] == "compile" and b["culprit"]["backend"] == "the path's own backend"
    assert b["fix"] == {"variant": "mine[backend=aot_eager_decomp_partition]", "ok": True}
    (f,) = fm.errors()
    assert f.cause == "backend-drops-grads" and "0.weight" in f.message
    assert "force_eager" in f.message and "aot_eager_decomp_partition" in f.fix


_WRAPPED_EARLY = torch.compile(_loss, backend=_lossy)  # at import time: no override can reach it


def test_a_path_compiled_before_it_is_built_is_not_overridable():
    def early(ctx):  # type: ignore[no-untyped-def]
        return lambda b, w: _WRAPPED_EARLY(ctx.model, b, torch.stack([w["mse"], w["l1"]]))

    fm = gradprobe.probe(_model(), lambda m, b: _terms(m, b), BATCH, variants=["eager", user_variant("early", early)],
                         diagnose=True)  # fmt: skip
    (b,) = fm.bisections
    assert b["trials"][0]["knob"] == "stance" and b["trials"][0]["ok"]
    assert b["not_overridable"] and b["culprit"] is None
    assert "not overridable" in b["summary"]
    (f,) = fm.errors()  # no backend is blamed without a measurement: the generic finding, with the bisection
    assert f.cause == "flow-mismatch" and "break is in compilation" in f.message


def test_a_path_broken_in_its_python_is_not_blamed_on_compilation():
    def python_cut(ctx):  # type: ignore[no-untyped-def]
        def loss(model, b, w):  # type: ignore[no-untyped-def]
            y = model[2](model[1](model[0](b["inp"])).detach())
            terms = {"mse": (y - b["tgt"]).pow(2).mean(), "l1": y.abs().mean()}
            return w[0] * terms["mse"] + w[1] * terms["l1"], terms

        compiled = torch.compile(loss, backend="eager")
        return lambda b, w: compiled(ctx.model, b, torch.stack([w["mse"], w["l1"]]))

    fm = gradprobe.probe(_model(), lambda m, b: _terms(m, b), BATCH, variants=["eager", user_variant("py", python_cut)],
                         diagnose=True)  # fmt: skip
    (b,) = fm.bisections
    assert [t["knob"] for t in b["trials"]] == ["stance"] and not b["trials"][0]["ok"]
    assert b["stage"] == "python"
    (f,) = fm.errors()
    assert f.cause == "graph-break-in-model" and f.location["variants"] == ["py"]
    assert ".detach()" in f.location["code"] and "break is in the path's Python" in f.message
