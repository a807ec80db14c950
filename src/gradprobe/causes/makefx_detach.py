"""makefx-detach: ``make_fx`` recorded ``detach`` nodes on tensors saved for backward (PyTorch #175477),
so a traced path loses second-order gradients and gets the rest wrong, whatever the backend."""

from __future__ import annotations

from ..flowmap import Finding, FlowMap
from .common import differing, names, runs_of, where
from .flow_mismatch import mismatch_summary

CAUSE = "makefx-detach"
DEFAULT_FIX = (
    "trace with detach decomposed to an alias (knob detach=alias; "
    "gradprobe.build.NO_DETACH_DECOMPOSITION as make_fx's decomposition_table) or strip the "
    "detach chains before compiling; or upgrade torch"
)


def detect(fm: FlowMap) -> list[Finding]:
    findings = []
    for v in fm.variants:
        graph = v.graph or {}
        if v.name == fm.reference or not graph.get("cutting_detach_nodes"):
            continue
        bad = differing(fm, v.name)
        if not bad:
            continue
        bis = fm.bisection(v.name)
        if bis is not None and (bis.get("culprit") or {}).get("knob") not in ("detach", None):
            continue  # bisection found another knob: not this cause
        summaries = [mismatch_summary(fm, v.name, s) for s in bad]
        worst = max((s for s in summaries if s), key=lambda s: (len(s["missing"]), len(s["wrong"])))
        first = graph.get("first_detach") or {}
        saved = first.get("saved") or {}
        lost = sorted({p for s in summaries if s for p in s["missing"]})
        err = worst["max_rel_error"]
        message = (
            f"the traced path drops second-order gradients (PyTorch #175477): {worst['scenario']}: "
            f"{worst['count']}/{len(fm.trainable)} params reached in {v.name} vs {worst['reference_count']}/"
            f"{len(fm.trainable)} in {fm.reference}"
            + (
                f"; {len(worst['wrong'])} of the {worst['count']} off by up to {err:.0%}"
                if worst["wrong"] and err
                else ""
            )
            + (f"; lost: {names(lost)}" if lost else "")
            + f"; where: {graph['cutting_detach_nodes']} aten.detach nodes on parameter-dependent tensors, first "
            f"{first.get('node')} at {where(saved or first)} (saved {saved.get('op', '?')} output)"
        )
        if bis is not None and bis.get("summary"):
            message += f"; bisect: {bis['summary']}"
        findings.append(
            Finding(
                CAUSE,
                "error",
                message,
                evidence={
                    "variant": v.name,
                    "runs": runs_of(v.name, bad),
                    "graph": graph,
                    "lost": lost,
                    "bisection": bis,
                },
                location={
                    "variant": v.name,
                    "node": first.get("node"),
                    **{k: saved.get(k) for k in ("file", "line", "code", "op") if saved.get(k) is not None},
                },
                fix=(graph.get("advice") or {}).get(CAUSE) or DEFAULT_FIX,
                references=("https://github.com/pytorch/pytorch/issues/175477",),
            )
        )
    return findings
