"""makefx-detach: a traced graph holds ``detach`` nodes on tensors saved for backward (PyTorch
#175477), so a traced path loses second-order gradients and gets the rest wrong, whatever the backend.

Evidence, in order of strength: the lineage of the path's step (the replayed graph's detach node cuts
a term off parameters it depends on: seen for any path that replays a ``make_fx`` trace, the user's
own included, no cooperation needed), then the lint of a graph the path hands over (``Built.graph``),
then the bisection (the detach knob restores the flow).
"""

from __future__ import annotations

from typing import Any

from ..claims import claim
from ..flowmap import Finding, FlowMap
from ..wording import names
from .common import Candidate, advice, differing, runs_of, where
from .lineage_cuts import cause_of, explained_runs, place_claims, places

CAUSE = "makefx-detach"
ALIAS = (
    "trace with detach decomposed to an alias (knob detach=alias; gradprobe.build.NO_DETACH_DECOMPOSITION as "
    "make_fx's decomposition_table)"
)
STRIP = "strip the detach chains on saved tensors before compiling"


def _candidates() -> list[Candidate]:
    return [
        Candidate(ALIAS, lambda p: p["capture"] == "make_fx" and p["knobs"].get("detach") == "alias"),
        Candidate(STRIP),
    ]


REFERENCES = ("https://github.com/pytorch/pytorch/issues/175477",)


def _replayed_detaches(fm: FlowMap, variant: str) -> list[dict[str, Any]]:
    """Detach nodes of a replayed graph in some term's history that cut parameter-dependent tensors:
    a term may lose parameters entirely, or only the part of their gradient that went through them
    (every parameter still reached, values wrong)."""
    lin = (fm.evidence.get("lineage") or {}).get(variant) or {}
    used = {i for t in (lin.get("terms") or {}).values() for i in t.get("sites") or ()}
    return [
        s for s in lin.get("sites") or () if s["id"] in used and s.get("parameters") and cause_of(s) == CAUSE
    ]


def detect(fm: FlowMap) -> list[Finding]:
    findings = []
    from_lineage: dict[str, list[Any]] = {}
    for place in places(fm):
        if cause_of(place.site) == CAUSE:
            for v in place.variants:
                from_lineage.setdefault(v, []).append(place)
    for v in fm.variants:
        if v.name == fm.reference:
            continue
        graph = v.graph or {}
        seen = from_lineage.get(v.name, [])
        partial = [
            s for s in _replayed_detaches(fm, v.name) if not any(pl.site["id"] == s["id"] for pl in seen)
        ]
        if not seen and not partial and not graph.get("cutting_detach_nodes"):
            continue
        bad = differing(fm, v.name)
        if not bad:
            continue
        bis = fm.bisection(v.name)
        if not seen and bis is not None and (bis.get("culprit") or {}).get("knob") not in ("detach", None):
            continue  # only the lint, and the bisection found another knob: not this cause
        findings.append(_finding(fm, v.name, bad, seen, partial, graph, bis))
    return findings


def _first_node(site: dict[str, Any]) -> str:
    what = f" ({site['detail']})" if site.get("detail") else ""
    if site.get("file"):
        return f"first {site.get('node')}{what} at {where(site)}"
    return (
        f"first {site.get('node')}{what} (the trace kept no stack traces: trace with record_stack_traces=True "
        "for the line)"
    )


def _finding(
    fm: FlowMap,
    v: str,
    bad: list[str],
    seen: list[Any],
    partial: list[dict[str, Any]],
    graph: dict[str, Any],
    bis: Any,
) -> Finding:
    summaries = [s for s in (fm.mismatch(v, sc) for sc in bad) if s]
    worst = max(summaries, key=lambda s: (len(s["missing"]), len(s["wrong"])))
    lost = sorted({p for s in summaries for p in s["missing"]})
    err = worst["max_rel_error"]
    message = (
        f"the traced path drops second-order gradients (PyTorch #175477): {worst['scenario']}: "
        f"{worst['count']}/{len(fm.trainable)} params reached in {v} vs {worst['reference_count']}/"
        f"{len(fm.trainable)} in {fm.reference}"
        + (
            f"; {len(worst['wrong'])} of the {worst['count']} off by up to {err:.0%}"
            if worst["wrong"] and err
            else ""
        )
        + (f"; lost: {names(lost)}" if lost else "")
    )
    sc = worst["scenario"]
    claims = [
        claim("count", f"{sc}: {worst['count']} reached in {v}", variant=v, scenario=sc, reached=worst["count"]),
        claim("count", f"{sc}: {worst['reference_count']} reached in {fm.reference}", variant=fm.reference,
              scenario=sc, reached=worst["reference_count"]),
        claim("differs", f"{', '.join(bad)} of {v} differ from {fm.reference}", variant=v, scenarios=bad),
    ]  # fmt: skip
    if worst["wrong"] and err:
        claims.append(claim("verdicts", f"{sc}: {len(worst['wrong'])} off by up to {err:.0%} in {v}", variant=v,
                            scenario=sc, parameters=worst["wrong"], verdict=["wrong"], at_least=err))  # fmt: skip
    for s in summaries:
        if s["missing"]:
            claims.append(claim("verdicts", f"{s['scenario']}: lost {names(s['missing'])} in {v}", variant=v,
                                scenario=s["scenario"], parameters=s["missing"], verdict=["missing"]))  # fmt: skip
    if seen:
        first = seen[0].site
        cut = sorted({p for pl in seen for p in pl.parameters})
        message += (
            f"; where: {len(seen)} detach node(s) in the replayed graph cut {', '.join(seen[0].terms)} off "
            f"{names(cut)}, {_first_node(first)}"
        )
        location = {**first, "variant": v}
        runs = [r for pl in seen for r in explained_runs(fm, pl) if r[0] == v] + runs_of(v, bad)
        for pl in seen[:3]:
            claims.extend(place_claims(fm, pl))
    elif partial:
        first = partial[0]
        message += (
            f"; where: {len(partial)} detach node(s) in the replayed graph sit on parameter-dependent tensors "
            f"used by the backward ops of the traced gradient (part of the gradient of {names(first['parameters'])} "
            f"is cut), {_first_node(first)}"
        )
        location = {**first, "variant": v}
        runs = runs_of(v, bad)
        claims.append(claim("site", f"detach node {first.get('node')} at {where(first)}", variant=v, kind="detach",
                            file=first.get("file"), line=first.get("line"),
                            parameters=list(first.get("parameters") or ())))  # fmt: skip
    else:
        first = graph.get("first_detach") or {}
        saved = first.get("saved") or {}
        message += (
            f"; where: {graph['cutting_detach_nodes']} aten.detach nodes on parameter-dependent tensors, first "
            f"{first.get('node')} at {where(saved or first)} (saved {saved.get('op', '?')} output)"
        )
        location = {
            "variant": v,
            "node": first.get("node"),
            **{k: saved.get(k) for k in ("file", "line", "code", "op") if saved.get(k) is not None},
        }
        runs = runs_of(v, bad)
        claims.append(claim("lint", f"the graph lint counted {graph['cutting_detach_nodes']} cutting detach nodes",
                            variant=v, cutting_detach_nodes=graph["cutting_detach_nodes"]))  # fmt: skip
    if bis is not None and bis.get("summary"):
        message += f"; bisect: {bis['summary']}"
        claims.append(claim("bisected", f"bisect: {bis['summary']}", variant=v, summary=bis["summary"]))
    own = (graph.get("advice") or {}).get(CAUSE)
    if own:
        claims.append(
            claim("path_advice", f"{v} hands over its own advice for {CAUSE}", variant=v, cause=CAUSE)
        )
        fix = f"{own} (the path's own advice)"
    else:
        tips = advice(fm, v, _candidates(), bad)
        claims.extend(tips.claims)
        fix = tips.text
    return Finding(
        CAUSE,
        "error",
        message,
        evidence={
            "variant": v,
            "runs": runs,
            "graph": graph or None,
            "sites": [pl.site for pl in seen] + partial,
            "lost": lost,
            "bisection": bis,
        },
        location=location,
        fix=fix,
        references=REFERENCES,
        claims=tuple(claims),
    )
