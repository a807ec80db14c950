"""trace-eval-mode: a path runs the model in eval mode, and an ``autograd.grad`` the step takes then
runs without ``create_graph`` (``create_graph=self.training``): the terms derived from it (forces,
virial) reach nothing, or their backward raises. In the reference path too: a step that calls
``model.eval()`` is an error by itself.

Evidence: the lineage of the path's step (``autograd.grad`` without ``create_graph`` while the module
is in eval mode cuts a term off the parameters it depends on; the ``.eval()`` call the step made, or
none: the model arrived in eval mode), or the bisection (flipping the module mode restores the flow).
The fix is advice from trials: ``mode=train`` verified by a bisection trial where one ran.
"""

from __future__ import annotations

from ..claims import claim
from ..flowmap import Finding, FlowMap
from .common import Candidate, advice, failed_runs, family, runs_of, where
from .lineage_cuts import cause_of, explained_runs, place_claims, places, where_seen

CAUSE = "trace-eval-mode"
TRAIN = "call model.train() before the step or the trace (knob mode=train)"


def _detached_symptom(error) -> bool:  # type: ignore[no-untyped-def]
    return error.type == "NoGradPath" or "backward through the graph a second time" in error.message


def _train(variant: str) -> Candidate:
    same = family(variant)
    return Candidate(TRAIN, lambda p: same(p) and p["knobs"].get("mode") == "train")


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
        claims = list(place_claims(fm, place))
        for v, s in place.sites.items():
            r = s.get("root")
            if r:
                claims.append(claim("mode_call", f"{r['module'] or 'the model'}.eval() at {where(r)} ({v})", variant=v,
                                    module=r["module"], mode="eval", file=r["file"], line=r["line"]))  # fmt: skip
            else:
                claims.append(
                    claim("no_mode_call", f"the step switched no module to eval mode ({v})", variant=v)
                )
        for v in place.variants:
            failed = [s for w, s in freed if w == v]
            if failed:
                claims.append(claim("run_failed", f"{', '.join(failed)} of {v} raise or have no gradient path",
                                    variant=v, scenarios=failed))  # fmt: skip
        if root:
            fix = f"remove the eval() call at {where(root)} (or call model.train() after it) (not tried)"
        else:
            tips = advice(fm, place.variants[0], [_train(place.variants[0])])
            claims += tips.claims
            fix = tips.text
        findings.append(
            Finding(
                CAUSE,
                "error",
                f"{', '.join(place.terms)}: {how}, and autograd.grad at {where(site)} ran with "
                f"{site.get('detail') or 'no create_graph'}: these terms have no gradient path to "
                f"{len(place.parameters)} parameter(s) they depend on" + (f"; {seen}" if seen else ""),
                evidence={
                    "variants": place.variants,
                    "runs": runs,
                    "site": site,
                    "parameters": place.parameters,
                },
                location={**(root or site), "variants": place.variants},
                fix=fix,
                claims=tuple(claims),
            )
        )
    for v in fm.variants:
        if v.name in covered:
            continue
        bis = fm.bisection(v.name)
        culprit = (bis or {}).get("culprit") or {}
        if bis is None or culprit.get("knob") != "mode":
            continue
        failed = failed_runs(fm, v.name, _detached_symptom)
        zero = [s for s in fm.scenario_names if fm.run(v.name, s).error is None and fm.count(v.name, s)[0] == 0
                and fm.run(fm.reference, s).error is None and fm.count(fm.reference, s)[0] > 0]  # fmt: skip
        symptomatic = failed + zero
        if not symptomatic:
            continue
        flip = next((t for t in bis.get("trials") or () if t.get("knob") == "mode" and t.get("ok")), None)
        claims = []
        if failed:
            claims.append(claim("run_failed", f"{', '.join(failed)} of {v.name} raise or have no gradient path",
                                variant=v.name, scenarios=failed))  # fmt: skip
        for s in zero:
            claims.append(
                claim("count", f"{s} in {v.name} reaches nothing", variant=v.name, scenario=s, reached=0)
            )
        if flip is not None:
            claims.append(claim("trial", f"trial {flip['change']}: {flip['result']}", variant=v.name,
                                change=flip["change"], ok=True))  # fmt: skip
        tips = advice(fm, v.name, [_train(v.name)], symptomatic)
        findings.append(
            Finding(
                CAUSE,
                "error",
                f"{', '.join(symptomatic)} in {v.name}: "
                + ("these runs raise or have no gradient path" if failed else "these terms reach nothing")
                + f"; bisect: flipping {culprit.get('change')} restores the flow"
                + (f" ({bis['summary']})" if bis.get("summary") else ""),
                evidence={"variant": v.name, "runs": runs_of(v.name, symptomatic), "bisection": bis},
                location={"variant": v.name, "knob": "mode"},
                fix=tips.text,
                claims=tuple(claims + tips.claims),
            )
        )
    return findings
