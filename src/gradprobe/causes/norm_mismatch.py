"""norm-mismatch: one term's value differs between paths by the same constant factor in every run,
and so do its gradients (same direction, norms scaled by that factor): the two implementations
normalise the term differently (per atom vs per frame, mean vs sum).

Evidence: term values per run, and per single-term run the cosine and the L2 ratio of the path's
gradient vector against the reference's (``Run.grad_cosine``, ``Run.grad_scale``) and every cell's
relative error (each parameter's gradient scaled by the factor: ``|factor - 1|``). A constant ratio
of values alone is not enough: runs differ only in weights, so any path that computes a term the same
way twice gives one; nor is a gradient vector of the right norm: a factor near 1 gives that to a path
that gets one small parameter wrong. Each fact is a claim on the map.
"""

from __future__ import annotations

import math

from ..claims import claim, scaled_cells
from ..flowmap import Finding, FlowMap
from .common import runs_of

CAUSE = "norm-mismatch"
RATIO_TOL = 1e-6
COSINE_MIN = 0.9999
SCALE_TOL = 1e-3


def detect(fm: FlowMap) -> list[Finding]:
    return _terms(fm) + _metrics(fm)


def _constant_ratio(pairs: list[tuple[float | None, float | None]]) -> float | None:
    """The common ratio a/b of the pairs where both are known and b is not 0; None if it varies."""
    # A metric of a switched-off term is NaN or 0 (DeePMD reports it so): those runs say nothing.
    known = [
        (a, b) for a, b in pairs if a is not None and b is not None and math.isfinite(a) and math.isfinite(b)
    ]
    ratios = [a / b for a, b in known if b != 0.0]
    if not ratios or not all(math.isfinite(r) for r in ratios):
        return None
    factor = ratios[0]
    return factor if all(abs(r - factor) <= RATIO_TOL * abs(factor) for r in ratios) else None


def _metrics(fm: FlowMap) -> list[Finding]:
    """A metric the step reports beside its loss (a trainer's rmse) at a constant factor of the
    reference's in every run: the paths normalise what they report differently. Metrics are not
    trained, so the value ratio is the whole evidence (and no gradient is claimed to differ)."""
    findings = []
    ref = fm.reference
    for v in fm.variant_names:
        if v == ref:
            continue
        names = sorted({k for s in fm.scenario_names for k in fm.run(v, s).metrics})
        for metric in names:
            pairs = [
                (fm.run(v, s).metrics.get(metric), fm.run(ref, s).metrics.get(metric))
                for s in fm.scenario_names
            ]
            factor = _constant_ratio(pairs)
            if factor is None or abs(factor - 1.0) <= RATIO_TOL:
                continue
            runs = [
                s
                for s, (a, b) in zip(fm.scenario_names, pairs, strict=True)
                if a is not None and b and math.isfinite(a) and math.isfinite(b)
            ]
            if any(fm.differences(v, s) or fm.run(v, s).error for s in runs):
                continue  # the gradients differ too: the metric follows them, not a normalisation
            claims = (
                claim("metric_ratio", f"metric {metric} is {factor:.6g}× its {ref} value in {v}, in every run "
                      f"where it is reported ({', '.join(runs)})", variant=v, metric=metric, scenarios=runs,
                      factor=factor),
                claim("matches", f"the gradients of {v} match {ref} in those runs", variant=v, scenarios=runs),
            )  # fmt: skip
            findings.append(
                Finding(
                    CAUSE,
                    "error",
                    f"{claims[0].text}, and {claims[1].text}: the two paths normalise {metric} differently "
                    "(a reported metric, not a trained term: the training curves it draws differ)",
                    evidence={
                        "variant": v,
                        "metric": metric,
                        "factor": factor,
                        "metric_runs": runs_of(v, runs),
                    },
                    location={"variant": v, "metric": metric},
                    claims=claims,
                    fix=f"align how {metric} is normalised (per atom, per frame, mean vs sum) between the paths",
                )
            )
    return findings


def _terms(fm: FlowMap) -> list[Finding]:
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
            # The gradients must scale with the value: same direction, norm times the factor, and
            # every parameter's gradient by that factor (not one small parameter off).
            if cos is None or scale is None or cos < COSINE_MIN or abs(scale / factor - 1.0) > SCALE_TOL:
                continue
            tol = SCALE_TOL * abs(factor - 1.0) + (fm.rtol if fm.rtol is not None else 1e-3)
            if not scaled_cells(fm, v, alone, factor, tol):
                continue
            # Every run computes (and reports) the term, switched on or not: each one differs.
            on = list(fm.scenario_names)
            claims = (
                claim("term_ratio", f"term {term} is {factor:.6g}× its {ref} value in {v}, in every run "
                      f"({', '.join(scenarios)})", variant=v, term=term, scenarios=scenarios, factor=factor),
                claim("grad_ratio", f"its gradients are too ({alone}: cosine {cos:.6f}, norm ratio {scale:.6g})",
                      variant=v, scenario=alone, cosine=cos, scale=scale),
                claim("scaled_cells", f"every parameter's gradient by that factor (relative error "
                      f"{abs(factor - 1):.3g} ± {tol:.1g})", variant=v, scenario=alone, factor=factor, tol=tol),
            )  # fmt: skip
            findings.append(
                Finding(
                    CAUSE,
                    "error",
                    f"{claims[0].text}, and {claims[1].text}; {claims[2].text}: the two paths normalise {term} "
                    "differently" + (f" (√factor = {math.sqrt(factor):.6g})" if factor > 0 else ""),
                    evidence={
                        "variant": v,
                        "term": term,
                        "factor": factor,
                        "runs": runs_of(v, on),
                        "grad_cosine": cos,
                        "grad_scale": scale,
                    },
                    location={"variant": v, "term": term},
                    claims=claims,
                    fix=f"align the normalisation of {term} (per atom, per frame, mean vs sum) between the paths",
                )
            )
    return findings
