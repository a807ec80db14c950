"""consistency-failed: the consistency check (allclose per element against the reference, float64
rtol=atol=1e-10) fails for a path that no other finding is about: values differ below the flow
table's tolerance but beyond what a correct compiled path reaches. Cells at noise
level in both runs are not compared (``compare.noise_floor``).
"""

from __future__ import annotations

from ..flowmap import Finding, FlowMap
from .common import Explained

CAUSE = "consistency-failed"


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
        parts = []
        if worst:
            w = worst[0]
            parts.append(f"{r['failed_cells']} of {r['checked_cells']} gradient cells beyond allclose, worst "
                         f"{w['parameter']} in {w['scenario']} (excess {w['excess']:.3g})")  # fmt: skip
        if terms:
            t = terms[0]
            parts.append(f"term {t['term']} = {t['value']:.10g} vs {t['reference']:.10g} in {t['scenario']}")
        findings.append(
            Finding(
                CAUSE,
                "error",
                f"{v} is not consistent with {fm.reference} (rtol {report.get('rtol'):g}, atol {report.get('atol'):g}): "
                + "; ".join(parts),
                evidence={
                    "variant": v,
                    "consistency": r,
                    "runs": sorted({(v, x["scenario"]) for x in worst + terms}),
                },
                location={"variant": v},
                fix="small but real differences: compare the path's numerics (dtype, reductions, fused ops) with "
                f"{fm.reference}; a path that is right reaches 1e-10 in float64",
            )
        )
    return findings
