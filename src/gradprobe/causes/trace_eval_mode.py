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
        # The root: the call in the step that switched the module to eval mode, where the lineage saw it;
        # else the model arrived in eval mode (set before the probe).
        root = site.get("root")
        how = (
            f"the step switches {root['module'] or 'the model'} to eval mode at {where(root)}"
            if root
            else "the model arrived in eval mode (no .eval() ran inside the step)"
        )
        findings.append(
            Finding(
                CAUSE,
                "error",
                f"{', '.join(place.terms)}: {how}, so forces computed with create_graph=self.training come out "
                f"detached and these terms have no gradient path to {len(place.parameters)} parameter(s) they "
                f"depend on — autograd.grad without create_graph at {where(site)}"
                + (f"; {seen}" if seen else ""),
                evidence={
                    "variants": place.variants,
                    "runs": runs,
                    "site": site,
                    "parameters": place.parameters,
                },
                location={**(root or site), "variants": place.variants},
                fix=FIX
                if root is None
                else f"remove the eval() call at {where(root)} (or call model.train() after it)",
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
