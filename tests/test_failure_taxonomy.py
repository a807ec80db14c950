"""Known compile failures are named (issue 16, item 3): each signature gets its own cause, with the
evidence read from the recorded error (type, message, traceback frames), the user's frame, the fix and
what the fix exposes next. Small models written like user code prove each on this torch; the real
packages where no small model shows it are in tests/test_real_packages.py."""

from __future__ import annotations

import os

import msgspec
import torch
from donation import donation
from torch import nn

import gradprobe
from gradprobe.diagnose import diagnose
from gradprobe.variants import user_variant


def _errors(fm: gradprobe.FlowMap) -> list[str]:
    return sorted({f.cause for f in fm.findings if f.severity == "error"})


class Pot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(3, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).sum()


X = torch.randn(5, 3)


def _terms(model, x):  # type: ignore[no-untyped-def]
    x = x.detach().requires_grad_(True)
    e = model(x)
    f = -torch.autograd.grad(e, x, create_graph=True)[0]
    return {"energy": e.pow(2), "force": f.pow(2).mean()}


def _warmed_up(ctx):  # type: ignore[no-untyped-def]
    """The model compiled (aot_eager) and trained first with a plain backward (an energy-only epoch, a
    validation pass): its backward is then compiled with donated buffers."""
    on = ctx.knobs.get("donated_buffer", True)
    with donation(on):
        compiled = torch.compile(ctx.model, backend="aot_eager")
        x = ctx.batch.detach().requires_grad_(True)  # as the step calls it: no recompile later
        torch.autograd.grad(compiled(x), list(ctx.model.parameters()))

    def run(batch, weights):  # type: ignore[no-untyped-def]
        with donation(on):
            terms = _terms(compiled, batch)
        return weights["energy"] * terms["energy"] + weights["force"] * terms["force"], terms

    return run


KNOBS = {"donated_buffer": (True, (True, False))}


def test_donated_buffers_are_named_with_the_user_line_and_what_turning_donation_off_exposes():
    variants = ["eager", user_variant("warm", _warmed_up, KNOBS),
                user_variant("warm", _warmed_up, KNOBS, donated_buffer=False)]  # fmt: skip
    fm = gradprobe.probe(Pot(), lambda m, b: _terms(m, b), X, variants=variants, progress=False)
    (f,) = [f for f in fm.findings if f.cause == "donated-buffers"]
    assert f.evidence["variant"] == "warm" and f.severity == "error"
    assert {tuple(r) for r in f.evidence["runs"]} == {("warm", s) for s in fm.scenario_names}
    assert os.path.basename(f.location["file"]) == "test_failure_taxonomy.py"
    assert "torch.autograd.grad" in f.location["code"]
    assert "donated_buffer = False" in f.fix
    # What the fix exposes next was measured: donation off, energy trains compiled and forces hit the
    # double backward.
    assert "warm[donated_buffer=false]" in f.evidence["next"] and "double backward" in f.evidence["next"]
    assert fm.run("warm[donated_buffer=false]", "energy only").error is None
    (d,) = [f for f in fm.findings if f.cause == "double-backward-unsupported"]
    assert d.evidence["variant"] == "warm[donated_buffer=false]"
    assert _errors(fm) == ["donated-buffers", "double-backward-unsupported"]
    assert "error: donated buffers" in gradprobe.render(fm)
    import torch._functorch.config as functorch_config

    assert functorch_config.donated_buffer is True


class Batch(dict):
    """A package's batch type: a dict whose length is not defined."""

    def __len__(self) -> int:
        raise NotImplementedError("Batch has no length")


class Reads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 1)

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.lin(batch["x"]).sum()


def test_a_dynamo_internal_error_on_a_user_object_names_the_object_type_and_the_user_frame():
    def step(m, b):  # type: ignore[no-untyped-def]
        y = m(b)
        return {"fit": y.pow(2), "reg": m.lin.weight.pow(2).sum()}

    fm = gradprobe.probe(Reads(), step, Batch(x=torch.randn(4, 3)), variants="eager,compile_model:aot_eager",
                         progress=False)  # fmt: skip
    assert fm.run("eager", "all").error is None
    (f,) = [f for f in fm.findings if f.cause == "dynamo-internal-error"]
    assert f.location["object_type"].endswith("test_failure_taxonomy.Batch")
    assert (
        f.location["function"] == "__len__"
        and os.path.basename(f.location["file"]) == "test_failure_taxonomy.py"
    )
    assert f.evidence["guard"] == "SEQUENCE_LENGTH" and "Batch has no length" in f.message
    assert _errors(fm) == ["dynamo-internal-error"]  # not run-failed as well
    err = fm.run("compile_model:aot_eager", "all").error
    assert err.type == "InternalTorchDynamoError" and any("guards.py" in fr for fr in err.frames)
    assert gradprobe.FlowMap.from_json(fm.to_json()).run("compile_model:aot_eager", "all").error == err


def test_an_unknown_failure_stays_run_failed_with_the_user_frame():
    def step(m, b):  # type: ignore[no-untyped-def]
        return {"fit": m(b).pow(2).mean()}

    def builder(ctx):  # type: ignore[no-untyped-def]
        compiled = torch.compile(ctx.model, backend="eager")

        def run(batch, weights):  # type: ignore[no-untyped-def]
            out = compiled(batch)
            if out.shape[0] == 4:
                raise ValueError("only in this path")
            return weights["fit"] * out.pow(2).mean()

        return run

    model = nn.Linear(3, 1)
    fm = gradprobe.probe(model, step, torch.randn(4, 3), variants=["eager", user_variant("mine", builder)],
                         progress=False)  # fmt: skip
    (f,) = [f for f in fm.findings if f.cause == "run-failed"]
    assert os.path.basename(f.location["file"]) == "test_failure_taxonomy.py"
    assert "only in this path" in f.message and _errors(fm) == ["run-failed"]


def test_backend_drops_grads_never_claims_a_difference_on_runs_that_raised():
    # The path's own backend blamed by a bisection (every override rung right), but the path's runs
    # raised: no gradient was measured to differ, so no backend finding.
    fm = gradprobe.probe(Pot(), lambda m, b: _terms(m, b), X, variants="eager,compile_model:aot_eager",
                         progress=False)  # fmt: skip
    bisection = {
        "variant": "compile_model:aot_eager", "scenarios": ["force only"], "stage": "compile", "irrelevant": [],
        "fix": None, "summary": "", "trials": [],
        "culprit": {"knob": "backend", "backend": "the path's own backend", "last_good": "eager", "ladder": True},
    }  # fmt: skip
    findings = diagnose(msgspec.structs.replace(fm, bisections=(bisection,)))
    assert "backend-drops-grads" not in {f.cause for f in findings}
    assert "double-backward-unsupported" in {f.cause for f in findings}


def test_the_donation_knob_is_spelled_and_refused_against_inductor() -> None:
    from gradprobe.errors import SpecError
    from gradprobe.variants import parse_variant

    v = parse_variant("compile_model:aot_eager[donated_buffer=false]")
    assert v.name == "compile_model:aot_eager[donated_buffer=false]" and v.knob("donated_buffer") is False
    assert parse_variant("compile:eager").knob("donated_buffer") is True
    import pytest

    with pytest.raises(SpecError, match="silently wrong gradients"):
        parse_variant("compile_model:inductor[donated_buffer=false]")


def test_a_donation_finding_without_a_measurement_says_how_to_measure_it() -> None:
    # A built-in variant failing on donated buffers (the recorded error of a run), no sibling variant.
    from gradprobe.flowmap import RunError

    fm = gradprobe.probe(Pot(), lambda m, b: _terms(m, b), X, variants="eager,compile_model:aot_eager",
                         progress=False)  # fmt: skip
    err = RunError("forward", "RuntimeError", "This backward function was compiled with non-empty donated "
                   "buffers which requires create_graph=False and retain_graph=False.")  # fmt: skip
    runs = tuple(
        msgspec.structs.replace(r, error=err) if r.variant == "compile_model:aot_eager" else r
        for r in fm.runs
    )
    (f,) = [f for f in diagnose(msgspec.structs.replace(fm, runs=runs)) if f.cause == "donated-buffers"]
    assert "add the variant compile_model:aot_eager[donated_buffer=false]" in f.fix
