"""dynamo-internal-error: dynamo itself fails while it compiles the user's code, most often when it
builds a guard on a user object: a ``list``/``dict`` subclass (a package's batch or config type) gets a
``len()`` guard, and the object's ``__len__`` raises (``NotImplementedError``). Eager code never calls
it, so only the compiled path fails, with ``InternalTorchDynamoError``.

Evidence: the error type, the message (the original exception), the guard that was being built (a
recorded frame in dynamo's ``guards.py``), the user's frame and the object's type (``where.object_type``).
"""

from __future__ import annotations

from ..flowmap import Finding, FlowMap, RunError
from .common import at_user, failing_variants, runs_of

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
                    f"dynamo treats {what} as a container and guards on it (len(), keys): give its type a working "
                    "__len__ (or no list/dict base class), or hand the compiled region plain tensors and dicts "
                    "(unpack the object outside it), or exclude the function that takes it with "
                    "torch._dynamo.disable. What it exposes next: the compile proceeds into the model; for a "
                    "force-trained potential that is double-backward-unsupported"
                ),
            )
        )
    return findings
