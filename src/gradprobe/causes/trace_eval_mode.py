"""trace-eval-mode: a path runs the model in eval mode, so forces computed with
``create_graph=self.training`` come out detached: force/virial terms reach nothing or their backward
raises. In the reference path too: a step that calls ``model.eval()`` is an error by itself.

Evidence: the lineage of the path's step (``autograd.grad`` without ``create_graph`` while the module
is in eval mode cuts a term off the parameters it depends on), or the bisection (flipping the module
mode restores the flow).
"""

from __future__ import annotations

from ..flowmap import Finding, FlowMap
from .common import failed_runs, runs_of, where
from .lineage_cuts import cause_of, explained_runs, places, where_seen

CAUSE = "trace-eval-mode"
FIX = (
    "call model.train() before the step or the trace (knob mode=train); forces need create_graph=True "
    "to train"
)


def _detached_symptom(error) -> bool:  # type: ignore[no-untyped-def]
    return error.type == "NoGradPath" or "backward through the graph a second time" in error.message


def detect(fm: FlowMap) -> list[Finding]:
    findings = []
    covered: set[str] = set()
    for place in places(fm):
        if cause_of(place.site) != CAUSE:
            continue
        covered.update(place.variants)
        site = place.site
        seen = where_seen(fm, place)
        # autograd.grad without retain_graph also frees the graph: the energy's own backward then raises.
        freed = [[v, s] for v in place.variants for s in failed_runs(fm, v, _detached_symptom)]
        runs = explained_runs(fm, place) + [r for r in freed if r not in explained_runs(fm, place)]
        findings.append(
            Finding(
                CAUSE,
                "error",
                f"{', '.join(place.terms)}: the model runs in eval mode, so forces computed with "
                "create_graph=self.training come out detached and these terms have no gradient path to "
                f"{len(place.parameters)} parameter(s) they depend on — autograd.grad without create_graph "
                f"at {where(site)}" + (f"; {seen}" if seen else ""),
                evidence={
                    "variants": place.variants,
                    "runs": runs,
                    "site": site,
                    "parameters": place.parameters,
                },
                location={**site, "variants": place.variants},
                fix=FIX,
            )
        )
    for v in fm.variants:
        if v.name in covered:
            continue
        bis = fm.bisection(v.name)
        if bis is None or (bis.get("culprit") or {}).get("knob") != "mode":
            continue
        failed = failed_runs(fm, v.name, _detached_symptom)
        zero = [s for s in fm.scenario_names if fm.run(v.name, s).error is None and fm.count(v.name, s)[0] == 0
                and fm.run(fm.reference, s).error is None and fm.count(fm.reference, s)[0] > 0]  # fmt: skip
        symptomatic = failed + zero
        if not symptomatic:
            continue
        findings.append(
            Finding(
                CAUSE,
                "error",
                f"{', '.join(symptomatic)} in {v.name}: the model runs in eval mode, so forces computed with "
                "create_graph=self.training come out detached and these terms have no gradient path"
                + (f"; bisect: {bis['summary']}" if bis.get("summary") else ""),
                evidence={"variant": v.name, "runs": runs_of(v.name, symptomatic), "bisection": bis},
                location={"variant": v.name, "knob": "mode"},
                fix=FIX,
            )
        )
    return findings
