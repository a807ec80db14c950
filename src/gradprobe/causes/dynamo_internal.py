"""dynamo-internal-error: dynamo itself fails while it compiles the user's code, most often when it
builds a guard on a user object: a ``list``/``dict`` subclass (a package's batch or config type) gets a
``len()`` guard, and the object's ``__len__`` raises (``NotImplementedError``). Eager code never calls
it, so only the compiled path fails, with ``InternalTorchDynamoError``.

Evidence: the error type, the message (the original exception), the guard that was being built (a
recorded frame in dynamo's ``guards.py``), the user's frame and the object's type (``where.object_type``).
"""

from __future__ import annotations

from ..claims import claim
from ..flowmap import Finding, FlowMap, RunError
from .common import at_user, failing_variants, failure_claims, runs_of

CAUSE = "dynamo-internal-error"
TYPES = ("InternalTorchDynamoError",)


def matches(error: RunError) -> bool:
    return error.type in TYPES or error.message.startswith("InternalTorchDynamoError")


def _guard(error: RunError) -> str | None:
    """The dynamo guard that was being built (``SEQUENCE_LENGTH``), from the recorded frames."""
    return next(
        (f.rpartition(" in ")[2] for f in reversed(error.frames) if f.startswith("guards.py:")),
        None,
    )


def detect(fm: FlowMap) -> list[Finding]:
    findings = []
    for v, failed, first in failing_variants(fm, matches):
        at = first.where or {}
        obj = at.get("object_type")
        guard = _guard(first)
        what = f"a {obj} object" if obj else "a user object"
        if first.type in TYPES:
            claims = failure_claims(fm, v.name, failed, first, type=first.type)
        else:
            claims = failure_claims(fm, v.name, failed, first, contains="InternalTorchDynamoError")
        s0 = next((s for s in failed if fm.run(v.name, s).error == first), None)
        if obj:
            claims.append(claim("error_object", f"the failing frame is a method of {obj}", variant=v.name,
                                scenario=s0, object_type=obj))  # fmt: skip
        if guard:
            claims.append(claim("error_frame", f"dynamo was building its {guard} guard", variant=v.name,
                                scenario=s0, function=guard))  # fmt: skip
        findings.append(
            Finding(
                CAUSE,
                "error",
                f"{v.name}: dynamo failed internally at {first.stage} in {', '.join(failed) or 'its build'} on "
                f"{what}"
                + (f" while building its {guard} guard" if guard else "")
                + f": {first.message}"
                + at_user(first),
                evidence={
                    "variant": v.name,
                    "runs": runs_of(v.name, failed),
                    "error": first,
                    "object_type": obj,
                    "guard": guard,
                },
                location={"variant": v.name, **at},
                fix=(
                    (f"dynamo guards on {what} ({guard}) and the call it makes raises: " if guard else "")
                    + "give its type a working __len__ (or no list/dict base class), or hand the compiled region "
                    "plain tensors and dicts (unpack the object outside it), or exclude the function that takes it "
                    "with torch._dynamo.disable (not tried). What it exposes next was not measured"
                ),
                claims=tuple(claims),
            )
        )
    return findings
