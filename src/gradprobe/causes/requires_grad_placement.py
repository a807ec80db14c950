"""requires-grad-placement: the path differentiates a tensor the loss does not depend on (the coordinates
were re-created after ``requires_grad_``), so coordinate-derived terms reach nothing.

Evidence: an ``autograd.grad`` call in some path's lineage whose input the differentiated output does
not use, and runs of that path with no gradient path or nothing reached."""

from __future__ import annotations

from ..claims import claim
from ..flowmap import Finding, FlowMap
from ..wording import names
from .common import failed_runs, runs_of, where

CAUSE = "requires-grad-placement"


def detect(fm: FlowMap) -> list[Finding]:
    lineage = fm.evidence.get("lineage") or {}
    found = {v: [s for s in lin.get("sites") or () if s.get("kind") == "autograd_grad_unused_input"]
             for v, lin in lineage.items()}  # fmt: skip
    located = [(v, s) for v in fm.variant_names for s in found.get(v, [])]
    if not located:
        return []
    b = located[0][1]
    runs = []
    claims = [
        claim("site", f"autograd.grad at {where(s)} differentiates an input the output does not use ({v})",
              variant=v, kind="autograd_grad_unused_input", file=s.get("file"), line=s.get("line"))
        for v, s in located[:3]
    ]  # fmt: skip
    for v in [v for v in fm.variant_names if found.get(v)]:
        failed = failed_runs(fm, v, lambda e: e.type == "NoGradPath")
        empty = [s for s in fm.scenario_names if fm.run(v, s).error is None and fm.count(v, s)[0] == 0]
        # The terms that reach nothing alone; every scenario holding one of them is a consequence.
        dead = {t for s in fm.scenarios if s.name in failed + empty for t in s.terms if len(s.terms) == 1}
        runs += runs_of(v, [s.name for s in fm.scenarios if s.name in failed + empty or dead & set(s.terms)])
        if failed:
            claims.append(claim("run_failed", f"{', '.join(failed)} of {v} have no gradient path", variant=v,
                                scenarios=failed, type="NoGradPath"))  # fmt: skip
        claims += [
            claim("count", f"{s} of {v} reaches nothing", variant=v, scenario=s, reached=0) for s in empty
        ]
    if not runs:
        return []
    scen = sorted({s for _, s in runs})
    return [
        Finding(
            CAUSE,
            "error",
            f"{', '.join(scen)}: the terms derived from that gradient reach no parameter: autograd.grad at "
            f"{where(b)} differentiates a tensor the output it differentiates does not use "
            f"({b.get('detail') or 'an unused input'})"
            + (f"; cut parameters: {names(b.get('parameters') or [])}" if b.get("parameters") else ""),
            evidence={"runs": runs, "break": b},
            location=b,
            fix="differentiate the tensor the model actually consumes: set requires_grad_ after preprocessing "
            "(canonicalisation, dtype/device copies), inside the traced region; never replace a None gradient by "
            "zeros (not tried)",
            claims=tuple(claims),
        )
    ]
