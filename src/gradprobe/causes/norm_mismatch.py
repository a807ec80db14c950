"""norm-mismatch: one term's value differs between paths by the same constant factor in every run,
and so do its gradients (same direction, norms scaled by that factor): the two implementations
normalise the term differently (per atom vs per frame, mean vs sum).

Evidence: term values per run, and per single-term run the cosine and the L2 ratio of the path's
gradient vector against the reference's (``Run.grad_cosine``, ``Run.grad_scale``). A constant ratio of
values alone is not enough: runs differ only in weights, so any path that computes a term the same
way twice gives one.
"""

from __future__ import annotations

import math

from ..flowmap import Finding, FlowMap
from .common import runs_of

CAUSE = "norm-mismatch"
RATIO_TOL = 1e-6
COSINE_MIN = 0.9999
SCALE_TOL = 1e-3


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
            if not ratios or not all(math.isfinite(r) for r in ratios):
                continue
            factor = ratios[0]
            constant = all(abs(r - factor) <= RATIO_TOL * abs(factor) for r in ratios)
            if not constant or abs(factor - 1.0) <= RATIO_TOL or factor <= 0:
                continue
            alone = next((s.name for s in fm.scenarios if s.terms == (term,)), None)
            if alone is None:
                continue
            run = fm.run(v, alone)
            cos, scale = run.grad_cosine, run.grad_scale
            # The gradients must scale with the value: same direction, norm times the factor.
            if cos is None or scale is None or cos < COSINE_MIN or abs(scale / factor - 1.0) > SCALE_TOL:
                continue
            # Every run computes (and reports) the term, switched on or not: each one differs.
            on = list(fm.scenario_names)
            findings.append(
                Finding(
                    CAUSE,
                    "error",
                    f"term {term} is {factor:.6g}× its {ref} value in {v}, in every run ({', '.join(scenarios)}), "
                    f"and its gradients are too ({alone}: cosine {cos:.6f}, norm ratio {scale:.6g}): the two paths "
                    f"normalise {term} differently"
                    + (
                        f" (√factor = {math.sqrt(factor):.6g}: a per-atom or per-frame factor, squared)"
                        if factor > 0
                        else ""
                    ),
                    evidence={
                        "variant": v,
                        "term": term,
                        "factor": factor,
                        "runs": runs_of(v, on),
                        "grad_cosine": cos,
                        "grad_scale": scale,
                    },
                    location={"variant": v, "term": term},
                    fix=f"align the normalisation of {term} (per atom, per frame, mean vs sum) between the paths",
                )
            )
    return findings
