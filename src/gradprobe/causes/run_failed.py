"""run-failed: a (variant, scenario) run raised or had no gradient path, and no more specific cause
in the catalogue explains it."""

from __future__ import annotations

from ..flowmap import Finding, FlowMap
from .common import Explained, where

CAUSE = "run-failed"


def detect(fm: FlowMap, explained: Explained | None = None) -> list[Finding]:
    skip = explained.runs if explained is not None else set()
    findings = []
    for v in fm.variants:
        failed = [
            r
            for r in fm.runs
            if r.variant == v.name and r.error is not None and (v.name, r.scenario) not in skip
        ]
        if v.error is not None and failed:
            at = v.error.where or {}
            findings.append(
                Finding(
                    CAUSE,
                    "error",
                    f"variant {v.name} failed to {v.error.stage}: {v.error.type}: {v.error.message}"
                    + (f" (at {where(at)})" if at else "")
                    + "; cause not known: no failure signature in the catalogue matches",
                    evidence={
                        "variant": v.name,
                        "stage": v.error.stage,
                        "type": v.error.type,
                        "runs": [[v.name, r.scenario] for r in failed],
                    },
                    fix="see the error; other variants were still measured",
                    location={"variant": v.name, **at} if at else None,
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
        findings.append(
            Finding(
                CAUSE,
                "error",
                f"{len(failed)} run(s) of {v.name} failed ({scen}): {first.stage}: {first.type}: {first.message}"
                + (f" (at {where(at)})" if at else "")
                + ("" if no_path else "; cause not known: no failure signature in the catalogue matches"),
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
                    "make the term depend on the parameters through autograd: run the model in train mode when "
                    "forces use create_graph=self.training, and remove no_grad/detach on the term's path"
                )
                if no_path
                else "see the error message; the other runs were still measured",
                location={"variant": v.name, **at} if at else None,
            )
        )
    return findings
