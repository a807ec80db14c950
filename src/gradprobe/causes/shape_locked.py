"""shape-locked: a traced or compiled variant fails or gives other gradients on a batch of other shapes
(frames, atoms, neighbours): the graph was specialised to the traced batch's shapes."""

from __future__ import annotations

from ..flowmap import Finding, FlowMap
from ..wording import names

CAUSE = "shape-locked"


def detect(fm: FlowMap) -> list[Finding]:
    findings = []
    for v, entry in (fm.checks.get("shape_sweep") or {}).items():
        if entry.get("error"):
            findings.append(
                Finding(
                    CAUSE,
                    "warning",
                    f"{v} does not run on a batch of other shapes ({entry['error']}): the traced graph is "
                    "specialised to the traced batch's shapes",
                    evidence={"variant": v, "shape_sweep": entry},
                    location={"variant": v},
                    fix="re-trace per shape, pad batches to fixed shapes, or trace with tracing_mode=symbolic / "
                    "compile with dynamic=True",
                )
            )
        elif entry.get("mismatched") or entry.get("term_values"):
            findings.append(
                Finding(
                    CAUSE,
                    "error",
                    f"{v} runs on a batch of other shapes but gets other gradients than {fm.reference} there: "
                    f"{names(entry.get('mismatched') or list(entry.get('term_values') or {}))}",
                    evidence={"variant": v, "shape_sweep": entry},
                    location={"variant": v},
                    fix="the graph kept trace-time shapes or sizes as constants: trace per shape or symbolically",
                )
            )
    return findings
