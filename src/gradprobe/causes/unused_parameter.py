"""unused-parameter: reached by no term in any scenario of the reference variant (may be intended).

Exact zeros and no gradient are told apart: a parameter whose gradient is *exactly zero* has a path to
a loss term that carries nothing at this point (a zero-initialised gate, a ReLU mask, a residual scale
at 0); it trains after the first steps and must not be frozen. One with *no gradient* has no path.
"""

from __future__ import annotations

from ..declarations import note_for
from ..flowmap import Finding, FlowMap
from ..status import ZERO
from ..wording import names
from .common import Explained, module_of

CAUSE = "unused-parameter"


def detect(fm: FlowMap, explained: Explained | None = None) -> list[Finding]:
    if not fm.variants:
        return []
    ref = fm.reference if fm.reference in fm.variant_names else fm.variants[0].name
    ok = [s for s in fm.scenarios if fm.run(ref, s.name).error is None]
    covered = {t for s in ok for t in s.terms}
    if not ok or covered != set(fm.terms):
        return []  # some term was never measured successfully: cannot call anything unused
    reached = set().union(*(fm.reached(ref, s.name) for s in ok))
    skip = explained.parameters if explained is not None else set()
    unused = [p for p in fm.trainable if p not in reached and p not in skip]
    if not unused:
        return []
    zeros = set().union(*(fm.with_status(ref, s.name, ZERO) for s in ok))
    zero = [p for p in unused if p in zeros]
    none = [p for p in unused if p not in zero]
    notes = {p: n for p in unused if (n := note_for(p, fm.notes)) is not None}
    findings = []
    if none:
        message = f"{len(none)} parameter(s) get no gradient from any term (no path to a loss): {names(none)}"
        mine = {p: notes[p] for p in none if p in notes}
        if mine:
            message += " — " + "; ".join(sorted(set(mine.values())))
        findings.append(
            Finding(
                CAUSE,
                "info",
                message,
                evidence={"variant": ref, "parameters": none, "notes": mine, "status": "none"},
                location={"modules": sorted({module_of(p) or p for p in none})},
                fix="intended (an auxiliary head)? leave it, or freeze it with requires_grad_(False); otherwise "
                "connect it to a loss term. Under DDP, unused parameters need find_unused_parameters=True",
            )
        )
    if zero:
        mine = {p: notes[p] for p in zero if p in notes}
        findings.append(
            Finding(
                CAUSE,
                "info",
                f"{len(zero)} parameter(s) get an exact zero gradient from every term: {names(zero)} — a path "
                "exists but carries nothing at this point (a zero-initialised gate or scale, a ReLU mask)"
                + (" — " + "; ".join(sorted(set(mine.values()))) if mine else ""),
                evidence={"variant": ref, "parameters": zero, "notes": mine, "status": "zero"},
                location={"modules": sorted({module_of(p) or p for p in zero})},
                fix="usually healthy: a zero-initialised gate trains after the first steps; do NOT freeze it. If "
                "it stays exactly zero in training, check what multiplies it",
            )
        )
    return findings
