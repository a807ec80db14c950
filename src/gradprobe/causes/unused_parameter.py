"""unused-parameter: reached by no term in any scenario of the reference variant (may be intended).

What was measured is said, never why: *no gradient* (no autograd path from any term to the
parameter) and an *exact zero* (a path that carries zero on this batch) are told apart, and where the
lineage of the step was recorded, whether any term's value depends on the parameter at all. An exact
zero on one batch says nothing about the next: it is not a reason to freeze the parameter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..claims import claim
from ..declarations import note_for
from ..flowmap import Claim, Finding, FlowMap
from ..status import NONE, ZERO
from ..wording import names
from .common import Explained, module_of

CAUSE = "unused-parameter"


def _recorded(fm: FlowMap, variant: str) -> Mapping[str, Any] | None:
    """The lineage's terms of that path, where it was recorded for every term of the map."""
    lineage = (fm.evidence.get("lineage") or {}).get(variant) or {}
    terms = lineage.get("terms") or {}
    return terms if terms and not lineage.get("error") else None


def lineage_claims(fm: FlowMap, variant: str, parameters: Sequence[str]) -> list[Claim]:
    """Whether any term's value depends on ``parameters`` (the recorded lineage), as claims."""
    terms = _recorded(fm, variant)
    if terms is None:
        return []
    shown = {t: ("the total loss" if t == "__total__" else t) for t in terms}
    used = {t: [p for p in parameters if p in set(tl.get("depends_on") or ())] for t, tl in terms.items()}
    free = [p for p in parameters if not any(p in ps for ps in used.values())]
    out = []
    if free:
        out.append(claim("none_depend", f"no term's value depends on {names(free)} (lineage of {variant})",
                         variant=variant, terms=list(terms), parameters=free))  # fmt: skip
    for t, ps in used.items():
        if ps:
            out.append(claim("depends", f"the value of {shown[t]} depends on {names(ps)} (lineage of {variant})",
                             variant=variant, term=t, parameters=ps))  # fmt: skip
    return out


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
    seen = {p: {fm.statuses(ref, s.name).get(p) for s in ok} for p in unused}
    none = [p for p in unused if seen[p] == {NONE}]
    zero = [p for p in unused if ZERO in seen[p] and seen[p] <= {NONE, ZERO}]
    notes = {p: n for p in unused if (n := note_for(p, fm.notes)) is not None}
    scenarios = [s.name for s in ok]
    findings = []
    if none:
        claims = [
            claim("statuses", f"{s}: no gradient", variant=ref, scenario=s, parameters=none, status=[NONE])
            for s in scenarios
        ]
        facts = lineage_claims(fm, ref, none)
        message = (
            f"{len(none)} parameter(s) get no gradient from any term in {ref} (no autograd path to a loss "
            f"term): {names(none)}" + "".join(f"; {c.text}" for c in facts)
        )
        mine = {p: notes[p] for p in none if p in notes}
        if mine:
            message += " — " + "; ".join(sorted(set(mine.values())))
            claims.append(claim("noted", "declared in notes", parameters=list(mine)))
        findings.append(
            Finding(
                CAUSE,
                "info",
                message,
                evidence={"variant": ref, "parameters": none, "notes": mine, "status": "none"},
                location={"modules": sorted({module_of(p) or p for p in none})},
                claims=(*claims, *facts),
                fix="if a parameter is meant to be unused, freeze it with requires_grad_(False) or declare it "
                "in notes; otherwise connect it to a loss term. Under DDP, unused parameters need "
                "find_unused_parameters=True",
            )
        )
    if zero:
        claims = [
            claim("statuses", f"{s}: no gradient or an exact zero", variant=ref, scenario=s, parameters=zero,
                  status=[NONE, ZERO])
            for s in scenarios
        ]  # fmt: skip
        for s in scenarios:
            zs = [p for p in zero if fm.statuses(ref, s).get(p) == ZERO]
            if zs:
                claims.append(claim("statuses", f"{s}: exact zero for {names(zs)}", variant=ref, scenario=s,
                                    parameters=zs, status=[ZERO]))  # fmt: skip
        facts = lineage_claims(fm, ref, zero)
        mine = {p: notes[p] for p in zero if p in notes}
        if mine:
            claims.append(claim("noted", "declared in notes", parameters=list(mine)))
        findings.append(
            Finding(
                CAUSE,
                "info",
                f"{len(zero)} parameter(s) get an exact zero gradient and never a non-zero one in {ref}: "
                f"{names(zero)} — a path to a loss term exists and carries zero on this batch"
                + "".join(f"; {c.text}" for c in facts)
                + (" — " + "; ".join(sorted(set(mine.values()))) if mine else ""),
                evidence={"variant": ref, "parameters": zero, "notes": mine, "status": "zero"},
                location={"modules": sorted({module_of(p) or p for p in zero})},
                claims=(*claims, *facts),
                fix="do NOT freeze them on this evidence alone: an exact zero on one batch says nothing about "
                "the next. Probe a batch that exercises them, or run the training check (--check training) to "
                "see whether they move",
            )
        )
    return findings
