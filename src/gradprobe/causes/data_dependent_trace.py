"""data-dependent-trace: tracing or compiling needs a value that depends on the data (``.item()``,
``int(t)``, ``bool(t)`` in an ``if``, ``.any()``, a size read from a tensor), which a trace cannot
know: ``make_fx`` in real mode refuses to read it, symbolic tracing and dynamo raise
``GuardOnDataDependentSymNode``. Seen on every real package where ``make_fx`` ran (neighbour counts,
``int(idx[-1])``, ``torch.all(mask == 1)``).

Evidence: the build or run error's message, and the user's frame it came from (``RunError.where``).
"""

from __future__ import annotations

from ..claims import claim
from ..flowmap import Finding, FlowMap, RunError
from .common import failure_claims, runs_of, where

CAUSE = "data-dependent-trace"
SIGNATURES = (
    "get value out of a tracing tensor",
    "GuardOnDataDependentSymNode",
    "guard on data-dependent",
    "data-dependent expression",
    "DataDependentOutputException",
    "Data dependent",
)


# torch.distributions checks a distribution's parameters against their constraints in __init__ (an `if`
# on a tensor): the frame the failing read comes from, and what switches the check off.
VALIDATION_FILE = "distribution.py"
VALIDATION_FIX = (
    "the value read is torch.distributions' argument validation (Distribution.__init__ checks the parameters "
    "against their constraints with an `if` on a tensor): build the distribution with validate_args=False, or "
    "call torch.distributions.Distribution.set_default_validate_args(False) before tracing, as torch.compile "
    "does for the whole process (not tried)"
)


def _in_validation(error: RunError) -> str | None:
    """'Distribution.__init__ (distribution.py:76)' where the error's traceback passes there."""
    for f in error.frames or ():
        place, _, function = f.rpartition(" in ")
        if function == "__init__" and place.partition(":")[0] == VALIDATION_FILE:
            return f"Distribution.__init__ ({place})"
    return None


def matches(error: RunError) -> bool:
    return any(s.lower() in f"{error.type}: {error.message}".lower() for s in SIGNATURES)


def _said(error: RunError) -> tuple[str | None, str]:
    """(exception type, text of the message) that carry the signature, for the claim."""
    message = error.message.lower()
    for sig in SIGNATURES:
        i = message.find(sig.lower())
        if i >= 0:
            return None, error.message[i : i + len(sig)]
    return error.type, ""


def detect(fm: FlowMap) -> list[Finding]:
    findings = []
    for v in fm.variants:
        failed = [r for r in fm.runs if r.variant == v.name and r.error is not None and matches(r.error)]
        errors = [v.error] if v.error is not None and matches(v.error) else [r.error for r in failed]
        if not errors:
            continue
        first = errors[0]
        assert first is not None
        at = first.where or {}
        advice = ((fm.evidence.get("advice") or {}).get(v.name) or {}).get(CAUSE)
        type_, contains = _said(first)
        claims = failure_claims(
            fm, v.name, [r.scenario for r in failed], first, contains=contains, type=type_
        )
        validation = _in_validation(first)
        if validation:
            claims.append(claim("error_frame", f"the failing read is in torch.distributions' {validation}",
                                variant=v.name, scenario=None if v.error is first else failed[0].scenario,
                                function="__init__", file=VALIDATION_FILE))  # fmt: skip
        if advice:
            claims.append(claim("path_advice", f"{v.name} hands over its own advice for {CAUSE}", variant=v.name,
                                cause=CAUSE))  # fmt: skip
        findings.append(
            Finding(
                CAUSE,
                "error",
                f"{v.name} cannot be traced: it reads a value that depends on the data ({first.stage}: {first.message})"
                + (f" at {where(at)}" if at else ""),
                evidence={
                    "variant": v.name,
                    "runs": runs_of(v.name, [r.scenario for r in failed]),
                    "error": first,
                },
                location={"variant": v.name, **at},
                fix=f"{advice} (the path's own advice)"
                if advice
                else VALIDATION_FIX
                if validation
                else "keep the value a tensor at that line (torch.where or a mask instead of an `if` on a tensor; sizes "
                "from the batch's shapes, not from its values); for torch.compile, "
                "torch._dynamo.config.capture_scalar_outputs=True lets .item() into the graph (not tried). A "
                "symbolic trace of a data-dependent size needs torch._check(...) hints, or fixed (padded) sizes",
                claims=tuple(claims),
            )
        )
    return findings
