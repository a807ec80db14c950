"""nonfinite-grad: a gradient holds NaN or Inf."""

from __future__ import annotations

from ..flowmap import Finding, FlowMap
from ..status import INF, NAN
from .common import names

CAUSE = "nonfinite-grad"


def detect(fm: FlowMap) -> list[Finding]:
    findings = []
    for v in fm.variant_names:
        for s in fm.scenario_names:
            bad = {p: c.status for p, c in fm.cells_of(v, s).items() if c.status in (NAN, INF)}
            if bad:
                findings.append(
                    Finding(
                        CAUSE,
                        "error",
                        f"{s} in {v}: {len(bad)} parameter gradient(s) are NaN or Inf: {names(bad)}",
                        evidence={"variant": v, "scenario": s, "parameters": bad},
                        fix="find the first op producing it (torch.autograd.detect_anomaly); guard divisions, "
                        "logs and square roots near zero with torch.where or an epsilon",
                    )
                )
    return findings
