"""shape-locked: a traced or compiled variant fails or gives other gradients on a batch of other shapes
(frames, atoms, neighbours): the graph was specialised to the traced batch's shapes."""

from __future__ import annotations

from ..claims import claim
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
                    f"{v} does not run on a batch of other shapes ({entry['error']})",
                    evidence={"variant": v, "shape_sweep": entry},
                    location={"variant": v},
                    fix="re-trace per shape, pad batches to fixed shapes, or trace with tracing_mode=symbolic / "
                    "compile with dynamic=True (not tried)",
                    claims=(
                        claim("shape_sweep", f"{v} raises on a batch of other shapes", variant=v, fails=True),
                    ),
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
                    fix="trace per shape or symbolically (tracing_mode=symbolic, dynamic=True) (not tried)",
                    claims=(
                        claim(
                            "shape_sweep",
                            f"{v} differs from {fm.reference} on a batch of other shapes",
                            variant=v,
                            fails=False,
                            parameters=list(entry.get("mismatched") or list(entry.get("term_values") or {})),
                        ),
                    ),
                )
            )
    return findings
