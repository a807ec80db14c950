"""unused-parameter: reached by no term in any scenario of the reference variant (may be intended)."""

from __future__ import annotations

from ..flowmap import Finding, FlowMap
from .common import Explained, module_of, names, note_for

CAUSE = "unused-parameter"


def detect(fm: FlowMap, explained: Explained | None = None) -> list[Finding]:
    if not fm.variants:
        return []
    ref = fm.variants[0].name
    ok = [s for s in fm.scenarios if fm.run(ref, s.name).error is None]
    covered = {t for s in ok for t in s.terms}
    if not ok or covered != set(fm.terms):
        return []  # some term was never measured successfully: cannot call anything unused
    reached = set().union(*(fm.reached(ref, s.name) for s in ok))
    skip = explained.parameters if explained is not None else set()
    unused = [p for p in fm.trainable if p not in reached and p not in skip]
    if not unused:
        return []
    notes = {p: n for p in unused if (n := note_for(p, fm.notes)) is not None}
    modules = sorted({module_of(p) or p for p in unused})
    message = f"{len(unused)} parameter(s) get no non-zero gradient from any term: {names(unused)}"
    if notes:
        message += " — " + "; ".join(sorted(set(notes.values())))
    return [
        Finding(
            CAUSE,
            "info",
            message,
            evidence={"variant": ref, "parameters": unused, "notes": notes},
            location={"modules": modules},
            fix="intended (an auxiliary head)? leave it, or freeze it with requires_grad_(False); otherwise connect "
            "it to a loss term. Under DDP, unused parameters need find_unused_parameters=True",
        )
    ]
