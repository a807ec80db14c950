"""trace-eval-mode: a path runs the model in eval mode, so forces computed with
``create_graph=self.training`` come out detached: force/virial terms reach nothing or their backward raises."""

from __future__ import annotations

from ..flowmap import Finding, FlowMap
from .common import failed_runs, runs_of, where

CAUSE = "trace-eval-mode"


def _detached_symptom(error) -> bool:  # type: ignore[no-untyped-def]
    return error.type == "NoGradPath" or "backward through the graph a second time" in error.message


def detect(fm: FlowMap) -> list[Finding]:
    located = [b for b in fm.breaks if b.get("kind") == "autograd_grad_no_create_graph"]
    findings = []
    for v in fm.variants:
        failed = failed_runs(fm, v.name, _detached_symptom)
        zero = [s for s in fm.scenario_names if fm.run(v.name, s).error is None and fm.count(v.name, s)[0] == 0
                and fm.run(fm.reference, s).error is None and fm.count(fm.reference, s)[0] > 0]  # fmt: skip
        symptomatic = failed + zero
        if not symptomatic:
            continue
        bis = fm.bisection(v.name)
        mode_flip = bis is not None and (bis.get("culprit") or {}).get("knob") == "mode"
        # The located autograd.grad(create_graph=False) was seen running the model as handed over.
        as_is = v.knobs.get("mode", "as-is") == "as-is" and v.capture in ("eager", "user")
        evidence_break = located[0] if located and as_is else None
        if not (mode_flip or evidence_break):
            continue
        message = (
            f"{', '.join(symptomatic)} in {v.name}: the model runs in eval mode, so forces computed with "
            "create_graph=self.training come out detached and these terms have no gradient path"
        )
        if evidence_break is not None:
            message += f" — autograd.grad without create_graph at {where(evidence_break)}"
        if bis is not None and bis.get("summary"):
            message += f"; bisect: {bis['summary']}"
        findings.append(
            Finding(
                CAUSE,
                "error",
                message,
                evidence={
                    "variant": v.name,
                    "runs": runs_of(v.name, symptomatic),
                    "bisection": bis,
                    "break": evidence_break,
                },
                location=evidence_break or {"variant": v.name, "knob": "mode"},
                fix="call model.train() before the step or the trace (knob mode=train); forces need "
                "create_graph=True to train",
            )
        )
    return findings
