"""norm-mismatch: one term's value differs between variants by the same constant factor in every run
(e.g. natoms): the two implementations normalise it differently."""

from __future__ import annotations

import math

from ..flowmap import Finding, FlowMap
from .common import runs_of

CAUSE = "norm-mismatch"


def detect(fm: FlowMap) -> list[Finding]:
    findings = []
    ref = fm.reference
    for v in fm.variant_names:
        if v == ref:
            continue
        for term in fm.terms:
            ratios, scenarios = [], []
            for s in fm.scenario_names:
                a, b = fm.run(v, s), fm.run(ref, s)
                x, y = a.term_values.get(term), b.term_values.get(term)
                if a.error is None and b.error is None and x is not None and y not in (None, 0.0):
                    ratios.append(x / y)
                    scenarios.append(s)
            if len(ratios) < 2 or not all(math.isfinite(r) for r in ratios):
                continue
            factor = ratios[0]
            constant = all(abs(r - factor) <= 1e-6 * abs(factor) for r in ratios)
            if not constant or abs(factor - 1.0) <= 1e-6:
                continue
            on = [s.name for s in fm.scenarios if term in s.terms]
            findings.append(
                Finding(
                    CAUSE,
                    "error",
                    f"term {term} is {factor:.6g}× its {ref} value in {v}, in every run ({', '.join(scenarios)}): "
                    f"the two paths normalise {term} differently"
                    + (
                        f" (√factor = {math.sqrt(factor):.6g}: a per-atom or per-frame factor, squared)"
                        if factor > 0
                        else ""
                    ),
                    evidence={"variant": v, "term": term, "factor": factor, "runs": runs_of(v, on)},
                    location={"variant": v, "term": term},
                    fix=f"align the normalisation of {term} (per atom, per frame, mean vs sum) between the paths",
                )
            )
    return findings
