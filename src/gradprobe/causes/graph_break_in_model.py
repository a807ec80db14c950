"""graph-break-in-model: parameters unreachable in every variant, eager too, because the model cuts the
chain (``detach``, ``no_grad``, ``.item()``, numpy, an integer cast) — named op, module and line."""

from __future__ import annotations

from ..flowmap import Finding, FlowMap
from .common import names, where

CAUSE = "graph-break-in-model"
CUTS = ("detach", "no_grad", "item", "numpy", "tolist", "int_cast")


def unreached_everywhere(fm: FlowMap) -> set[str]:
    ok = [(v, s) for v in fm.variant_names for s in fm.scenario_names if fm.run(v, s).error is None]
    if not ok:
        return set()
    reached = set().union(*(fm.reached(v, s) for v, s in ok))
    return {p for p in fm.trainable if p not in reached}


def detect(fm: FlowMap) -> list[Finding]:
    unreached = unreached_everywhere(fm)
    findings = []
    for b in fm.breaks:
        cut = sorted(unreached & set(b.get("parameters") or ()))
        if b.get("kind") not in CUTS or not cut:
            continue
        findings.append(
            Finding(
                CAUSE,
                "error",
                f"{len(cut)} parameter(s) get no gradient from any term in any variant: {names(cut)} — "
                f"the chain is cut by {b.get('op')} ({b['kind']}) at {where(b)}",
                evidence={"parameters": cut, "break": b},
                location=b,
                fix=f"remove the {b['kind']} on the path from these parameters to the loss (or, if they should "
                "not train, freeze them with requires_grad_(False))",
            )
        )
    return findings
