"""flow-mismatch: a variant reaches other parameters than the reference, or gets their values wrong,
and no more specific cause in the catalogue explains it.

A generic finding: it gives the measured facts — per differing run, the counts, the parameters lost
(no gradient, an exact zero, or a gradient at noise level), the extra ones, the wrong values with the
largest relative error, and the bisection's summary where one ran — each as a claim, and says the
cause is not known."""

from __future__ import annotations

from typing import Any

from ..claims import claim
from ..flowmap import Claim, Finding, FlowMap
from ..wording import names
from .common import Explained

CAUSE = "flow-mismatch"

_LOST = {
    "none": "no gradient",
    "zero": "exact zero: a path that carries zero here",
    "nonzero": "a gradient at noise level",
}


def mismatch_claims(fm: FlowMap, variant: str, s: dict[str, Any]) -> list[Claim]:
    """The facts of one differing run (``FlowMap.mismatch``) as claims, in the order they are said."""
    sc = s["scenario"]
    out = [
        claim("counts", f"{sc}: {s['count']} reached vs {s['reference_count']}", variant=variant,
              scenario=sc, reached=s["count"], reference=s["reference_count"])
    ]  # fmt: skip
    if s["missing"]:
        cells = fm.cells_of(variant, sc)
        out.append(claim("verdicts", f"lost {names(s['missing'])}", variant=variant, scenario=sc,
                         parameters=list(s["missing"]), verdict=["missing"]))  # fmt: skip
        by_status: dict[str, list[str]] = {}
        for p in s["missing"]:
            by_status.setdefault(cells[p].status, []).append(p)
        for status, ps in by_status.items():
            if status in _LOST:
                out.append(claim("statuses", f"{names(ps)}: {_LOST[status]}", variant=variant, scenario=sc,
                                 parameters=ps, status=[status]))  # fmt: skip
    if s["extra"]:
        out.append(claim("verdicts", f"extra {names(s['extra'])}", variant=variant, scenario=sc,
                         parameters=list(s["extra"]), verdict=["extra"]))  # fmt: skip
    if s["wrong"]:
        cells = fm.cells_of(variant, sc)
        out.append(claim("verdicts", f"{len(s['wrong'])} with wrong values", variant=variant, scenario=sc,
                         parameters=list(s["wrong"]), verdict=["wrong"]))  # fmt: skip
        worst = s["max_rel_error"]
        if worst is not None:
            shown = next(p for p in s["wrong"] if cells[p].rel_error == worst)
            out.append(claim("verdicts", f"relative error up to {worst:.2g} ({shown})", variant=variant,
                             scenario=sc, parameters=[shown], verdict=["wrong"], at_least=worst))  # fmt: skip
        nonfinite = [p for p in s["wrong"] if cells[p].status in ("nan", "inf")]
        if nonfinite:
            out.append(claim("statuses", f"NaN/Inf for {names(nonfinite)}", variant=variant, scenario=sc,
                             parameters=nonfinite, status=["nan", "inf"]))  # fmt: skip
    return out


def describe(fm: FlowMap, variant: str, s: dict[str, Any]) -> str:
    """'force only: 12 reached vs 14; lost a, b; a: no gradient; …' — the claims' texts of one run."""
    return "; ".join(c.text for c in mismatch_claims(fm, variant, s))


def detect(fm: FlowMap, explained: Explained | None = None) -> list[Finding]:
    skip = explained.runs if explained is not None else set()
    findings = []
    for v in fm.variant_names:
        if v == fm.reference:
            continue
        summaries = [
            s for sc in fm.scenario_names if (v, sc) not in skip and (s := fm.mismatch(v, sc)) is not None
        ]
        if not summaries:
            continue
        per_run = [mismatch_claims(fm, v, s) for s in summaries]
        claims = [c for cs in per_run for c in cs]
        message = (
            f"{v} does not match {fm.reference}: "
            + " | ".join("; ".join(c.text for c in cs) for cs in per_run)
            + "; cause not known: no cause in the catalogue matches what was measured"
        )
        fix = (
            f"compare {v} with {fm.reference} parameter by parameter (the diff below); bisect the "
            "variant's knobs (capture, detach handling, mode, backend) to find the step that breaks it"
        )
        bis = fm.bisection(v)
        if bis is not None and bis.get("summary"):
            message += f"; bisect: {bis['summary']}"
            claims.append(claim("bisected", f"bisect: {bis['summary']}", variant=v, summary=bis["summary"]))
            culprit, verified = bis.get("culprit"), bis.get("fix") or {}
            if culprit is not None and verified.get("ok"):
                fix = f"{culprit['change']}: {verified['variant']} matches {fm.reference} (verified)"
                claims.append(claim("bisect_fixed", f"{verified['variant']} matches {fm.reference}",
                                    variant=v, fix=verified["variant"]))  # fmt: skip
        severity = "error"
        physics = fm.checks.get("physics") or {}
        if physics and not physics.get("passed", True) and not physics.get("error"):
            # The reference fails a check of its own: it, not this path, is the suspect.
            severity = "warning"
            message += (
                f" — but {fm.reference} itself fails the physics check (its forces are not -dE/dx): the "
                f"comparison is with a reference that is wrong there; {v} may be the right one"
            )
            claims.append(
                claim("check", f"{fm.reference} fails the physics check", name="physics", passed=False)
            )
            fix = f"fix {fm.reference} first (see the physics findings), then compare again"
        findings.append(
            Finding(
                CAUSE,
                severity,
                message,
                evidence={
                    "variant": v,
                    "reference": fm.reference,
                    "scenarios": summaries,
                    "bisection": bis,
                    "runs": [[v, s["scenario"]] for s in summaries],
                },
                fix=fix,
                claims=tuple(claims),
            )
        )
    return findings
