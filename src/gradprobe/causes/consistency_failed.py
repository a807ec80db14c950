"""consistency-failed: the consistency check fails for a path that no other finding is about.

The check judges every (scenario, parameter) as the flow map's cells are — the relative L1 error
against the reference's gradient of that parameter, the reference run's noise floor — at a tighter
rtol (float64: 1e-10), and term values relatively (``checks.consistency_report``). A path the table
calls right can still fail it: values that differ below the table's tolerance but beyond what a
correct compiled path reaches. The finding gives the counts, the worst cells with their relative
errors and the worst term value, each as a claim on the map's cells and runs.
"""

from __future__ import annotations

from ..claims import claim
from ..flowmap import Finding, FlowMap
from .common import Explained

CAUSE = "consistency-failed"
# What the table says of a cell that fails the check (``checks.consistency_report``'s verdicts).
_VERDICT = {
    "wrong": "wrong in the table too",
    "missing": "not reached, reached in the reference",
    "extra": "reached, not in the reference",
    "off": "within the table's tolerance",
    "nonfinite": "NaN or Inf",
}


def detect(fm: FlowMap, explained: Explained | None = None) -> list[Finding]:
    skip = explained.runs if explained is not None else set()
    report = fm.checks.get("consistency") or {}
    findings = []
    for v, r in (report.get("variants") or {}).items():
        if r.get("passed") or not (r.get("failed_cells") or r.get("terms")):
            continue  # passed, or nothing compared (failed runs are another cause's)
        if any(run_variant == v for run_variant, _ in skip):
            continue  # another finding is about this path already: its inconsistency is that one
        worst = [w for w in r.get("worst") or () if (v, w["scenario"]) not in skip]
        terms = [t for t in r.get("terms") or () if (v, t["scenario"]) not in skip]
        if not worst and not terms:
            continue
        rtol = float(r.get("rtol", report.get("rtol")))
        claims = [
            claim("check", f"the consistency check of {v} fails", name="consistency", passed=False, variant=v)
        ]
        if worst:
            w = worst[0]
            error = w.get("rel_error")
            shown = ", ".join(
                x
                for x in (
                    f"relative error {error:.2g}" if error is not None else "",
                    _VERDICT.get(w.get("verdict")),
                )
                if x
            )
            claims.append(
                claim(
                    "beyond",
                    f"{r['failed_cells']} of {r['checked_cells']} gradient cells beyond it, worst {w['parameter']} "
                    f"in {w['scenario']} ({shown})",
                    variant=v,
                    scenario=w["scenario"],
                    parameter=w["parameter"],
                    rtol=rtol,
                    at_least=float(error) if error is not None and error == error else 0.0,
                )
            )
        if terms:
            t = terms[0]
            gap = t.get("rel_error")
            claims.append(
                claim(
                    "term_gap",
                    f"term {t['term']} = {t['value']:.10g} vs {t['reference']:.10g} in {t['scenario']}",
                    variant=v,
                    scenario=t["scenario"],
                    term=t["term"],
                    at_least=float(gap) if gap is not None and gap == gap and gap != float("inf") else 0.0,
                )
            )
        findings.append(
            Finding(
                CAUSE,
                "error",
                f"{v} is not consistent with {fm.reference} (relative L1 error per parameter above {rtol:g}, "
                "beyond the noise floor): " + "; ".join(c.text for c in claims[1:]),
                evidence={
                    "variant": v,
                    "consistency": r,
                    "runs": sorted({(v, x["scenario"]) for x in worst + terms}),
                },
                location={"variant": v},
                claims=tuple(claims),
                fix="compare the path's numerics (dtype, reductions, fused ops) with "
                f"{fm.reference} on these parameters; a path that is right reaches {rtol:g} here",
            )
        )
    return findings
