"""flow-mismatch: a variant reaches other parameters than the reference, or gets their values wrong,
and no more specific cause in the catalogue explains it."""

from __future__ import annotations

from ..flowmap import Finding, FlowMap
from ..wording import names
from .common import Explained

CAUSE = "flow-mismatch"


def describe(s: dict) -> str:
    parts = [f"{s['scenario']}: {s['count']} reached vs {s['reference_count']}"]
    if s["missing"]:
        zero = set(s.get("missing_zero") or ())
        none = [p for p in s["missing"] if p not in zero]
        lost = [f"{names(none)} (no gradient)"] if none else []
        lost += [f"{names(sorted(zero))} (exact zero)"] if zero else []
        parts.append("lost " + "; ".join(lost))
    if s["extra"]:
        parts.append(f"extra {names(s['extra'])}")
    if s["wrong"]:
        err = f" (rel. error up to {s['max_rel_error']:.2g})" if s["max_rel_error"] is not None else ""
        parts.append(f"{len(s['wrong'])} of the {s['count']} reached have wrong values{err}")
    return "; ".join(parts)


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
        message = (
            f"{v} does not match {fm.reference}: "
            + " | ".join(describe(s) for s in summaries)
            + "; cause not known: no cause in the catalogue matches what was measured"
        )
        fix = (
            f"compare {v} with {fm.reference} parameter by parameter (the diff below); bisect the "
            "variant's knobs (capture, detach handling, mode, backend) to find the step that breaks it"
        )
        bis = fm.bisection(v)
        if bis is not None and bis.get("summary"):
            message += f"; bisect: {bis['summary']}"
            culprit, verified = bis.get("culprit"), bis.get("fix") or {}
            if culprit is not None and verified.get("ok"):
                fix = f"{culprit['change']}: {verified['variant']} matches {fm.reference} (verified)"
        severity = "error"
        physics = fm.checks.get("physics") or {}
        if physics and not physics.get("passed", True):
            # The reference fails a check of its own: it, not this path, is the suspect.
            severity = "warning"
            message += (
                f" — but {fm.reference} itself fails the physics check (its forces are not -dE/dx): the "
                f"reference is the culprit; {v} may well be the right one"
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
            )
        )
    return findings
