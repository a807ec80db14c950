"""donated-buffers: AOTAutograd compiled a backward that frees ("donates") its saved activations, so it
may run once per forward only; a later backward through the same compiled graph with
``create_graph=True`` or ``retain_graph=True`` (forces, a Hessian, a retained graph) raises "This
backward function was compiled with non-empty donated buffers". On torch 2.13 a backward is compiled
this way when the first backward through the graph was a plain one (an energy-only step, a validation
pass with a plain ``backward()``); seen on TorchANI 2.9 with the model compiled (``compile_model:aot_eager``).

Evidence: the run or build error's message; the user's frame (the ``autograd.grad`` call, in the
package's own source); what the fix exposes next is quoted when it was measured: a bisection trial
that flipped a ``donated_buffer`` knob, or the same path with ``donated_buffer=false`` in the map.
"""

from __future__ import annotations

from typing import Any

from ..claims import claim
from ..flowmap import Finding, FlowMap, RunError
from ..variants import NO_DONATION_BACKENDS
from .common import at_user, failing_variants, failure_claims, has_run, knob_trial, runs_of

CAUSE = "donated-buffers"
SIGNATURE = "non-empty donated buffers"
KNOB = "donated_buffer"

FIX = (
    "set torch._functorch.config.donated_buffer = False before the model is first compiled (with the aot_eager "
    "or eager backend; never against an inductor cache compiled with donation, which gave silently wrong "
    "gradients), and restore it after; or keep every backward through this compiled module at "
    "create_graph=False, retain_graph=False (do not mix a plain backward and a force backward on one graph)"
)
NEXT = (
    "what it exposes next was not measured here; on torch 2.13 (TorchANI, SchNetPack) donation off exposed "
    "create-graph-tangent-strides or double-backward-unsupported"
)


def matches(error: RunError) -> bool:
    return SIGNATURE in error.message


def _next_measured(fm: FlowMap, variant: str) -> tuple[str, list[Any]] | None:
    """What the path did with donation off, where that was measured, and the claims that show it."""
    trial = knob_trial(fm, variant, KNOB)
    if trial is not None:
        change = trial.get("change", KNOB + "=false")
        return f"measured with {change}: {trial.get('result')}", [
            claim("trial", f"trial {change}: {trial.get('result')}", variant=variant, change=change,
                  ok=bool(trial.get("ok")))
        ]  # fmt: skip
    base = variant.partition("[")[0]
    for other in fm.variants:
        if other.name != variant and other.name.partition("[")[0] == base and f"{KNOB}=false" in other.name:
            if other.error is not None:
                e = other.error
                return (
                    f"measured: {other.name} (donation off) then fails at {e.stage} with {named(e)}: {e.type}: "
                    f"{e.message}",
                    [claim("build_failed", f"the build of {other.name} failed: {e.type}", variant=other.name,
                           type=e.type, contains=e.message)],
                )  # fmt: skip
            failed = [r for r in fm.runs if r.variant == other.name and r.error is not None]
            if not failed:
                ran = [s for s in fm.scenario_names if has_run(fm, other.name, s)]
                return f"measured: {other.name} (donation off) runs", [
                    claim("ran", f"{other.name} runs", variant=other.name, scenarios=ran)
                ]
            e = failed[0].error
            assert e is not None
            return (
                f"measured: {other.name} (donation off) then fails at {e.stage} with {named(e)}: {e.type}: "
                f"{e.message}",
                [claim("run_failed", f"{failed[0].scenario} of {other.name} fails: {e.type}", variant=other.name,
                       scenarios=[failed[0].scenario], type=e.type, contains=e.message)],
            )  # fmt: skip
    return None


def _spelled_off(name: str) -> str:
    """``compile_model:aot_eager[dynamic=true]`` -> ``compile_model:aot_eager[dynamic=true,donated_buffer=false]``."""
    if name.endswith("]"):
        return name[:-1] + f",{KNOB}=false]"
    return name + f"[{KNOB}=false]"


def named(error: RunError) -> str:
    """The catalogue's name for what donation off exposed."""
    from . import create_graph_strides, dynamo_internal

    if "double backward" in error.message:
        return "double-backward-unsupported"
    if create_graph_strides.matches(error):
        return create_graph_strides.CAUSE
    if dynamo_internal.matches(error):
        return dynamo_internal.CAUSE
    return "another failure"


def detect(fm: FlowMap) -> list[Finding]:
    findings = []
    for v, failed, first in failing_variants(fm, matches):
        measured = _next_measured(fm, v.name)
        if measured is None and v.capture != "user" and v.backend in NO_DONATION_BACKENDS:
            hint = f"; measure it: add the variant {_spelled_off(v.name)}"
        else:
            hint = ""
        claims = failure_claims(fm, v.name, failed, first, contains=SIGNATURE)
        if measured is not None:
            claims += measured[1]
        findings.append(
            Finding(
                CAUSE,
                "error",
                f"{v.name} raises at {first.stage} in {', '.join(failed) or 'its build'}: its compiled backward was "
                "compiled with donated buffers (it frees its saved activations), and a backward with "
                f"create_graph/retain_graph (forces) went through it{at_user(first)}",
                evidence={
                    "variant": v.name,
                    "runs": runs_of(v.name, failed),
                    "error": first,
                    "next": measured[0] if measured else NEXT,
                },
                location={"variant": v.name, **(first.where or {})},
                fix=f"{FIX}. Next, {measured[0]}"
                if measured
                else f"{FIX}{hint}. {NEXT[0].upper()}{NEXT[1:]}",
                claims=tuple(claims),
            )
        )
    return findings
