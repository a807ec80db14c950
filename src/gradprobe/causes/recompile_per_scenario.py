"""recompile-per-scenario: a compiled variant recompiles per scenario, or silently falls back to eager
past dynamo's recompile limit, because loss weights or flags enter the compiled region as Python values."""

from __future__ import annotations

from ..flowmap import Finding, FlowMap
from .common import failed_runs, runs_of

CAUSE = "recompile-per-scenario"


def detect(fm: FlowMap) -> list[Finding]:
    findings = []
    for v in fm.variants:
        if v.backend is None:
            continue
        runs = [r for r in fm.runs if r.variant == v.name]
        later = [r.scenario for r in runs[1:] if r.compiled_graphs]
        fallback = failed_runs(fm, v.name, lambda e: e.type == "DynamoFallback")
        if not later and not fallback:
            continue
        parts = []
        if later:
            parts.append(
                f"compiled again in {len(later)} of {len(runs) - 1} later scenario(s) ({', '.join(later)})"
            )
        if fallback:
            parts.append(f"ran eager, not compiled, in {', '.join(fallback)} (dynamo fallback)")
        findings.append(
            Finding(
                CAUSE,
                "error",
                f"{v.name} "
                + " and ".join(parts)
                + ": the step turns per-term weights or flags into Python numbers "
                "or bools inside the compiled region, so dynamo specialises the graph per scenario; past the "
                "recompile limit (8) it silently runs eager",
                evidence={
                    "variant": v.name,
                    "runs": runs_of(v.name, fallback),
                    "compiled_graphs": {r.scenario: r.compiled_graphs for r in runs},
                },
                location={"variant": v.name},
                fix="pass loss weights and flags as 0-dim tensors and multiply (w * term), never float(w), bool(w) "
                "or `if find_force:` inside the compiled step",
            )
        )
    return findings
