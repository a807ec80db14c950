"""run-failed: a (variant, scenario) run raised or had no gradient path, and no more specific cause
in the catalogue explains it. It states the recorded facts — the error, the user's (or package's)
frame it came from, the innermost recorded frame, the bisection's outcome where one ran — and says
"cause not known" rather than guess one."""

from __future__ import annotations

from ..claims import claim
from ..flowmap import Finding, FlowMap, RunError
from .common import Explained, failure_claims, where

CAUSE = "run-failed"


def _facts(fm: FlowMap, variant: str, error: RunError) -> tuple[str, list]:  # type: ignore[type-arg]
    """'; innermost frame: ...; bisect: ...' and the claims of the bisection."""
    text, claims = "", []
    if error.frames:
        text += f"; innermost recorded frame: {error.frames[-1]}"
    bis = fm.bisection(variant)
    if bis is not None and bis.get("summary"):
        text += f"; bisect: {bis['summary']}"
        claims.append(claim("bisected", f"bisect: {bis['summary']}", variant=variant, summary=bis["summary"]))
    return text, claims


def detect(fm: FlowMap, explained: Explained | None = None) -> list[Finding]:
    skip = explained.runs if explained is not None else set()
    recorded = bool(fm.evidence.get("lineage"))
    findings = []
    for v in fm.variants:
        failed = [
            r
            for r in fm.runs
            if r.variant == v.name and r.error is not None and (v.name, r.scenario) not in skip
        ]
        if v.error is not None and failed:
            at = v.error.where or {}
            facts, more = _facts(fm, v.name, v.error)
            findings.append(
                Finding(
                    CAUSE,
                    "error",
                    f"variant {v.name} failed to {v.error.stage}: {v.error.type}: {v.error.message}"
                    + (f" (at {where(at)})" if at else "")
                    + facts
                    + "; cause not known: no failure signature in the catalogue matches",
                    evidence={
                        "variant": v.name,
                        "stage": v.error.stage,
                        "type": v.error.type,
                        "runs": [[v.name, r.scenario] for r in failed],
                    },
                    fix="see the error; other variants were still measured",
                    location={"variant": v.name, **at} if at else None,
                    claims=(
                        *failure_claims(fm, v.name, [], v.error, contains=v.error.message, type=v.error.type),
                        *more,
                    ),
                )
            )
            continue
        if not failed:
            continue
        first = failed[0].error
        assert first is not None
        scen = ", ".join(r.scenario for r in failed)
        no_path = all(r.error is not None and r.error.type == "NoGradPath" for r in failed)
        at = first.where or {}
        facts, more = _facts(fm, v.name, first)
        claims = [
            claim(
                "run_failed",
                f"{scen} of {v.name} failed",
                variant=v.name,
                scenarios=[r.scenario for r in failed],
            ),
            *failure_claims(fm, v.name, [failed[0].scenario], first, contains=first.message, type=first.type),
            *more,
        ]
        findings.append(
            Finding(
                CAUSE,
                "error",
                f"{len(failed)} run(s) of {v.name} failed ({scen}): {first.stage}: {first.type}: {first.message}"
                + (f" (at {where(at)})" if at else "")
                + facts
                + (
                    "; cause not known: no cut in the recorded lineage explains it"
                    if no_path and recorded
                    else "; cause not known"
                    if no_path
                    else "; cause not known: no failure signature in the catalogue matches"
                ),
                evidence={
                    "variant": v.name,
                    "runs": [[v.name, r.scenario] for r in failed],
                    "scenarios": [r.scenario for r in failed],
                    "errors": [
                        {"scenario": r.scenario, "stage": r.error.stage, "type": r.error.type}
                        for r in failed
                        if r.error is not None
                    ],
                },
                fix=(
                    "find where the term's value stops carrying gradient"
                    + ("" if recorded else ": run with diagnose=True (--diagnose), whose lineage can name it")
                )
                if no_path
                else "see the error message; the other runs were still measured",
                location={"variant": v.name, **at} if at else None,
                claims=tuple(claims),
            )
        )
    return findings
