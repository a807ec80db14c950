"""frozen-trace: a traced variant matches the reference on the batch it was traced on but not on a
second batch of the same shapes: the trace froze trace-time tensors (``pre_dispatch=True`` does)."""

from __future__ import annotations

from ..claims import claim
from ..flowmap import Finding, FlowMap
from ..wording import names

CAUSE = "frozen-trace"


def detect(fm: FlowMap) -> list[Finding]:
    findings = []
    for v in fm.variants:
        sb = v.second_batch
        if not sb or v.name == fm.reference or not (sb.get("mismatched") or sb.get("term_values")):
            continue
        if fm.differences(v.name, sb["scenario"]):
            continue  # already wrong on the first batch: flow-mismatch or a specific cause explains it
        parts = []
        if sb.get("mismatched"):
            parts.append(
                f"{len(sb['mismatched'])} parameter gradient(s) differ (rel. error up to {sb['max_rel_error']:.2g}): "
                f"{names(sb['mismatched'])}"
            )
        for term, values in (sb.get("term_values") or {}).items():
            parts.append(f"term {term} = {values['variant']:.6g} vs {values['reference']:.6g}")
        claims = [
            claim("matches", f"{v.name} matches {fm.reference} in {sb['scenario']} on the traced batch",
                  variant=v.name, scenarios=[sb["scenario"]]),
            claim("second_batch", f"on a second batch of the same shapes {v.name} differs: " + "; ".join(parts),
                  variant=v.name, parameters=list(sb.get("mismatched") or ()),
                  terms=list(sb.get("term_values") or ())),
        ]  # fmt: skip
        findings.append(
            Finding(
                CAUSE,
                "error",
                f"{v.name} matches {fm.reference} on the batch it was traced on but not on a second batch of the "
                f"same shapes ({sb['scenario']}): " + "; ".join(parts),
                evidence={"variant": v.name, "second_batch": sb},
                fix="cause not known beyond that: look for values the graph took from the traced batch (constants, "
                "closures, globals; pre_dispatch=True freezes trace-time tensors) and make them inputs of the "
                "trace, or re-trace per batch (not tried)",
                claims=tuple(claims),
            )
        )
    return findings
