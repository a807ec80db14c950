"""Bisection re-uses what a flip does not change (issue 20, item 2): one make_fx trace for every trial
that changes only the compile, and the probe's own run for a trial of a variant it measured. The
culprit and every trial's verdict are those of the bisection that recomputes everything.

Traces are counted by wrapping gradprobe's own ``build.trace_step``; torch is not patched.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._dynamo import list_backends, register_backend
from torch._dynamo.backends.debugging import aot_eager

import gradprobe
from gradprobe import build as build_module
from gradprobe.build import TraceCache, VariantContext
from gradprobe.step import make_weights
from gradprobe.variants import parse_variants

LOSSY = "test_reuse_lossy"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))


def _terms(model: nn.Module, b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    y = model(b["inp"])
    return {"mse": (y - b["tgt"]).pow(2).mean(), "l1": y.abs().mean()}


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"inp": torch.randn(16, 3, generator=g), "tgt": torch.randn(16, 2, generator=g)}


def _register_lossy() -> None:
    """aot_eager after a buggy pass that detaches the first layer's weight (a backend bug)."""
    if LOSSY in list_backends(exclude_tags=()):
        return

    @register_backend(name=LOSSY)  # type: ignore[misc]
    def lossy(gm: torch.fx.GraphModule, example_inputs: list) -> object:  # type: ignore[type-arg]
        for node in list(gm.graph.nodes):
            if node.op == "placeholder" and "0_weight" in node.name:
                with gm.graph.inserting_after(node):
                    cut = gm.graph.call_function(torch.detach, (node,))
                node.replace_all_uses_with(cut, delete_user_cb=lambda user, cut=cut: user is not cut)
        gm.recompile()
        return aot_eager(gm, example_inputs)


def _counting(monkeypatch) -> list[str]:  # type: ignore[no-untyped-def]
    traced: list[str] = []
    real = build_module.trace_step

    def trace_step(ctx, variant):  # type: ignore[no-untyped-def]
        traced.append(variant.name)
        return real(ctx, variant)

    monkeypatch.setattr(build_module, "trace_step", trace_step)
    return traced


def test_the_backend_ladder_traces_once_and_takes_the_failing_rung_from_the_probe(monkeypatch) -> None:
    _register_lossy()
    traced = _counting(monkeypatch)
    failing = f"make_fx+compile:{LOSSY}"
    fm = gradprobe.probe(
        _model(), _terms, _batch(), variants=f"eager,{failing}", diagnose=True, progress=False
    )
    (b,) = fm.bisections
    # The verdicts of the full recomputation: the trace alone is right, every standard rung is right,
    # the path's own backend breaks it.
    assert [(t["change"], t["ok"]) for t in b["trials"]] == [
        (f"{failing} → make_fx (no compile)", True),
        ("backend → eager", True),
        ("backend → aot_eager", True),
        ("backend → aot_eager_decomp_partition", True),
        (f"backend → {LOSSY}", False),
    ]
    assert b["culprit"]["backend"] == LOSSY and b["culprit"]["last_good"] == "aot_eager_decomp_partition"
    # One trace for the probe's measurement, one for the whole bisection (four trials would have
    # traced four times); the failing rung is the probe's own run, not a fifth build and compile.
    assert traced == [failing, "make_fx"]
    assert [t.get("reused") for t in b["trials"]] == [None, "trace", "trace", "trace", "measurement"]
    assert "re-used" in b["trials"][-1]["result"] and b["trials"][-1]["seconds"] < 0.05
    # Each trial that ran says where its time went.
    for t in b["trials"][:-1]:
        assert {"build_s", "compile_s", "run_s"} <= set(t) and t["seconds"] >= t["build_s"]
    assert b["trials"][0]["compile_s"] == 0 and b["trials"][2]["compile_s"] > 0
    assert [f.cause for f in fm.findings if f.severity == "error"] == ["backend-drops-grads"]


def _ctx(model: nn.Module, batch: dict[str, torch.Tensor]) -> VariantContext:
    terms = ["mse", "l1"]
    first = next(model.parameters())
    return VariantContext(model, _terms, "terms", terms, batch, make_weights(terms, terms, first))


def test_a_kept_trace_is_keyed_by_everything_that_changes_it(monkeypatch) -> None:
    traced = _counting(monkeypatch)
    model, batch = _model(), _batch()
    cache = TraceCache()
    v = {s: parse_variants(s)[0] for s in ("make_fx", "make_fx+compile:eager", "make_fx[detach=alias]",
                                              "make_fx[mode=eval]", "make_fx+compile:aot_eager[dynamic=true]")}  # fmt: skip
    first = cache.trace(_ctx(model, batch), v["make_fx"])
    again = cache.trace(_ctx(model, batch), v["make_fx+compile:eager"])  # only the compile differs
    cache.trace(_ctx(model, batch), v["make_fx+compile:aot_eager[dynamic=true]"])
    assert (cache.traced, cache.reused) == (1, 2) and len(traced) == 1
    # Each build gets its own module and generated code: dynamo's per-code-object cache is not shared.
    assert again is not first and again.forward.__code__ is not first.forward.__code__
    params = {f"model.{n}": p for n, p in model.named_parameters()}  # the step holder's names
    packed = torch.ones(2, dtype=torch.float32)
    want, got = first(params, {}, batch, packed), again(params, {}, batch, packed)
    assert torch.equal(want[0], got[0])

    cache.trace(_ctx(model, batch), v["make_fx[detach=alias]"])  # a capture knob
    cache.trace(_ctx(model, batch), v["make_fx[mode=eval]"])
    assert cache.traced == 3
    cache.trace(_ctx(model, _batch(1)), v["make_fx"])  # another batch
    assert cache.traced == 4
    with torch.no_grad():  # the user's state changed in place (an optimizer step would do this)
        model[0].weight.add_(0.0)
    cache.trace(_ctx(model, batch), v["make_fx"])
    assert cache.traced == 5
    model.eval()  # "as-is" traces whatever mode the modules are in
    cache.trace(_ctx(model, batch), v["make_fx"])
    assert cache.traced == 6
    cache.trace(_ctx(model, batch), v["make_fx+compile:eager"])
    assert (cache.traced, cache.reused) == (6, 3)
    assert len(traced) == 6


def test_a_failed_trace_is_not_kept(monkeypatch) -> None:
    traced = _counting(monkeypatch)

    def data_dependent(model: nn.Module, b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        y = model(b["inp"])
        if float(y.sum()) > 1e9:  # make_fx with fake tensors cannot read a value
            y = y * 2
        return {"mse": (y - b["tgt"]).pow(2).mean(), "l1": y.abs().mean()}

    model, batch = _model(), _batch()
    ctx = _ctx(model, batch)
    ctx.step = data_dependent
    (v,) = parse_variants("make_fx[tracing_mode=symbolic]")
    cache = TraceCache()
    for _ in range(2):
        try:
            cache.trace(ctx, v)
        except Exception:
            pass
        else:
            raise AssertionError("a symbolic trace of a data-dependent branch should fail")
    assert len(traced) == 2 and cache.traced == 0


def _potential(model: nn.Module, b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A tiny potential: energy of each configuration, forces by autograd.grad(create_graph=True)."""
    pos = b["inp"].clone().requires_grad_(True)
    energy = model(pos).sum()
    (grad,) = torch.autograd.grad(energy, pos, create_graph=True)
    return {"mse": (energy - b["tgt"].sum()).pow(2), "l1": (-grad - b["tgt"][:, :1]).pow(2).mean()}


def _scalar_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))


def test_two_compiles_of_one_broken_trace_share_their_make_fx_stage(monkeypatch) -> None:
    # make_fx keeps the detach nodes it records around autograd.grad(create_graph=True): the force
    # term comes out wrong (makefx-detach) whatever compiles the trace afterwards.
    traced = _counting(monkeypatch)
    eager_c, aot_c = "make_fx+compile:eager", "make_fx+compile:aot_eager"
    fm = gradprobe.probe(_scalar_model(), _potential, _batch(), variants=f"eager,{eager_c},{aot_c}",
                         diagnose=True, progress=False)  # fmt: skip
    first, second = fm.bisections
    assert (first["variant"], second["variant"]) == (eager_c, aot_c)
    verdicts = [(t["knob"], t["ok"]) for t in first["trials"]]
    assert verdicts == [("capture", False), ("detach", True), ("mode", False), ("fix", True)]
    assert [(t["knob"], t["ok"]) for t in second["trials"]] == verdicts
    assert first["culprit"]["knob"] == second["culprit"]["knob"] == "detach"
    assert first["fix"] == {"variant": "make_fx[detach=alias]+compile:eager", "ok": True}
    assert second["fix"] == {"variant": "make_fx[detach=alias]+compile:aot_eager", "ok": True}
    # The second bisection ran only its own fix, on the first's detach=alias trace.
    assert [t.get("reused") for t in first["trials"]] == [None, None, None, "trace"]
    assert [t.get("reused") for t in second["trials"]] == ["trial", "trial", "trial", "trace"]
    # One trace per measured variant, then three (keep, alias, eval) for both bisections.
    assert traced == [eager_c, aot_c, "make_fx", "make_fx[detach=alias]", "make_fx[mode=eval]"]
