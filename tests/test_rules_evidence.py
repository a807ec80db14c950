"""Rules judge on the right evidence (issue 15, part 4): each test builds the situation where the old
rule said something the measurement did not support, and checks what is said now."""

from __future__ import annotations

import os

import torch
from torch import nn

import gradprobe
from gradprobe.compare import negligible, noise_floor, verdict
from gradprobe.variants import user_variant


def _errors(fm: gradprobe.FlowMap) -> list[str]:
    return sorted(f.cause for f in fm.findings if f.severity == "error")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 1)).double()


X = torch.randn(10, 3, dtype=torch.float64)


def _step(m, b):  # type: ignore[no-untyped-def]
    y = m(b)
    return {"fit": y.pow(2).mean(), "reg": m[0].weight.pow(2).sum()}


def _path(transform):  # type: ignore[no-untyped-def]
    def builder(ctx):  # type: ignore[no-untyped-def]
        def run(b, w):  # type: ignore[no-untyped-def]
            terms = _step(ctx.model, b)
            terms["fit"] = transform(terms["fit"])
            return w["fit"] * terms["fit"] + w["reg"] * terms["reg"], terms

        return run

    return builder


def test_norm_mismatch_needs_gradients_scaled_like_the_value():
    scaled = gradprobe.probe(
        _mlp(), _step, X, variants=["eager", user_variant("sum", _path(lambda t: 10 * t))]
    )
    assert _errors(scaled) == ["norm-mismatch"]
    (f,) = scaled.errors()
    assert f.evidence["factor"] == 10.0 and abs(f.evidence["grad_scale"] - 10.0) < 1e-9
    # The same constant value ratio with gradients that do not follow (a detached copy) is not a
    # normalisation difference: the path's fit term is cut from every parameter.
    frozen = gradprobe.probe(
        _mlp(),
        _step,
        X,
        variants=["eager", user_variant("copy", _path(lambda t: 10 * t.detach()))],
        diagnose=True,
    )
    assert "norm-mismatch" not in _errors(frozen)
    (cut,) = [f for f in frozen.errors() if f.cause == "graph-break-in-model"]
    assert (
        cut.location["variants"] == ["copy"]
        and os.path.basename(cut.location["file"]) == "test_rules_evidence.py"
    )


def test_backend_drops_grads_needs_gradients_measured_to_differ():
    # A bisection that blames a backend rung which *raised* names no backend bug.
    from gradprobe.diagnose import diagnose

    fm = gradprobe.probe(_mlp(), _step, X)
    bisection = {
        "variant": "eager", "scenarios": ["fit only"], "stage": "compile", "irrelevant": [], "fix": None,
        "summary": "", "trials": [{"knob": "backend", "change": "backend → aot_eager", "variant": "x",
                                   "ok": False, "result": "backward: RuntimeError: boom"}],
        "culprit": {"knob": "backend", "backend": "aot_eager", "last_good": "eager", "ladder": True},
    }  # fmt: skip
    import msgspec

    assert not [
        f
        for f in diagnose(msgspec.structs.replace(fm, bisections=(bisection,)))
        if f.cause == "backend-drops-grads"
    ]


def test_noise_floor_makes_rounding_noise_of_a_zero_gradient_match():
    floor = noise_floor([1.0, 1e-14, None], [1, 1, 1], "float64")
    assert negligible("nonzero", 1e-14, 1, floor) and not negligible("nonzero", 1e-3, 1, floor)
    assert negligible("zero", 0.0, 1, floor) and negligible("none", None, 1, floor)
    # 1e-14 against 3e-14: relative error 2, but both are noise: a match, not "wrong".
    assert verdict("nonzero", "nonzero", 2.0, 1e-7, (True, True)) == "match"
    # Noise against a real gradient is not "reached".
    assert verdict("nonzero", "nonzero", 1.0, 1e-7, (False, True)) == "missing"
    assert verdict("nonzero", "nonzero", 1.0, 1e-7) == "wrong"


def test_zero_initialised_gate_is_not_called_unused_and_not_to_be_frozen():
    class Gated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(3, 4)
            self.gate = nn.Parameter(torch.zeros(4))  # ReZero-style: starts closed
            self.branch = nn.Linear(4, 4)
            self.head = nn.Linear(4, 1)
            self.aux = nn.Linear(4, 1)  # really unused

        def forward(self, x):  # type: ignore[no-untyped-def]
            h = torch.tanh(self.body(x))
            return self.head(h + self.gate * self.branch(h))

    torch.manual_seed(0)
    fm = gradprobe.probe(Gated(), lambda m, b: {"fit": m(b).pow(2).mean()}, torch.randn(8, 3))
    unused = {f.evidence["status"]: f for f in fm.findings if f.cause == "unused-parameter"}
    assert set(unused["none"].evidence["parameters"]) == {"aux.weight", "aux.bias"}
    assert set(unused["zero"].evidence["parameters"]) == {"branch.weight", "branch.bias"}
    assert "do NOT freeze" in unused["zero"].fix and "freeze it" in unused["none"].fix
    assert fm.exit_code == 0


def test_a_reference_that_fails_physics_is_the_culprit_not_the_other_path():
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.k = nn.Parameter(torch.tensor(2.0, dtype=torch.float64))

        def energy(self, pos):  # type: ignore[no-untyped-def]
            return self.k * (pos[:, 0] - pos[:, 1]).pow(2).sum(-1)

    def predict(m, b):  # type: ignore[no-untyped-def]
        x = b["pos"].clone().requires_grad_(True)
        return {"force": torch.autograd.grad(m.energy(x).sum(), x, create_graph=True)[0]}  # wrong sign

    def step(m, b):  # type: ignore[no-untyped-def]
        f = predict(m, b)["force"]
        return {"e": m.energy(b["pos"]).mean(), "f": f.pow(2).mean()}

    def builder(ctx):  # type: ignore[no-untyped-def]
        def run(b, w):  # type: ignore[no-untyped-def]
            t = step(ctx.model, b)
            t["f"] = t["f"] + 0.1 * t["e"]  # differs from the reference, not by a factor
            return w["e"] * t["e"] + w["f"] * t["f"], t

        return run

    spec = gradprobe.ProbeSpec(
        model=Pair(), step=step, batch={"pos": torch.randn(3, 2, 3, dtype=torch.float64)},
        energy_fn=lambda m, b: m.energy(b["pos"]), predict=predict, coord_key="pos", box_key=None,
    )  # fmt: skip
    fm = gradprobe.probe(spec, variants=["eager", user_variant("other", builder)], checks=["physics"])
    assert _errors(fm) == ["forces-not-conservative"] and fm.exit_code == 1
    (mismatch,) = [f for f in fm.findings if f.cause == "flow-mismatch"]
    assert mismatch.severity == "warning" and "a reference that is wrong there" in mismatch.message
