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
    return _terms(fm) + _metrics(fm) + _recomputed(fm)


_POWERS = ((1.0, "natoms"), (-1.0, "1/natoms"), (2.0, "natoms²"), (-2.0, "1/natoms²"), (0.5, "√natoms"),
           (-0.5, "1/√natoms"))  # fmt: skip


def factor_words(factor: float, natoms: int | None) -> str:
    """'natoms = 6' when the factor is a power of the atom count (the usual per-atom slip), else ''."""
    if not natoms or natoms < 2:
        return ""
    for k, name in _POWERS:
        if abs(factor - natoms**k) <= 1e-6 * natoms**k:
            return f"{name} = {natoms**k:.6g}" if name != "natoms" else f"natoms = {natoms}"
    return ""


def _recomputed(fm: FlowMap) -> list[Finding]:
    """A metric a trainer reports (DeePMD's rmse_e/f/v, rmse) that differs from gradprobe's own
    recomputation by the documented definition, from the same call's outputs and labels
    (``checks["metrics"]``; per backend in ``checks["backends"]["metrics"]``). Paths of one backend share
    its loss: comparing them cannot see this; the definition can."""
    findings: list[Finding] = []
    seen: set[tuple[str, str]] = set()
    for check in ("metrics", "backends"):
        result = fm.checks.get(check)
        if not isinstance(result, dict) or result.get("error"):
            continue
        metrics = result.get("metrics") if check == "backends" else result
        if not isinstance(metrics, dict):
            continue
        natoms = metrics.get("natoms")
        for path, rows in (metrics.get("paths") or {}).items():
            for metric, row in rows.items():
                if row.get("passed", True) or (path, metric) in seen or not row.get("recomputed"):
                    continue
                factor = float(row["reported"]) / float(row["recomputed"])
                if not math.isfinite(factor):
                    continue
                seen.add((path, metric))
                named = factor_words(factor, natoms)
                definition = (metrics.get("definitions") or {}).get(metric, "the documented definition")
                claims = (
                    claim("metric_recomputed", f"{metric} reported by {path} is {factor:.6g}× its recomputation by "
                          f"the documented definition ({definition}) from the same call's outputs and labels"
                          + (f", on a batch of {natoms} atoms" if named else ""),
                          check=check, path=path, metric=metric, factor=factor,
                          **({"natoms": natoms} if named else {})),
                )  # fmt: skip
                findings.append(
                    Finding(
                        CAUSE,
                        "error",
                        f"{claims[0].text}: the factor is {named or f'{factor:.6g}'}; {path}'s loss normalises "
                        f"{metric} otherwise than documented, and every path that shares that loss reports it so "
                        "(comparing those paths cannot see it)",
                        evidence={
                            "check": check,
                            "path": path,
                            "metric": metric,
                            "factor": factor,
                            "factor_named": named,
                            "natoms": natoms,
                            "reported": row["reported"],
                            "recomputed": row["recomputed"],
                        },
                        location={"check": check, "path": path, "metric": metric},
                        claims=claims,
                        fix=f"normalise {metric} as documented ({definition}) in {path}'s loss"
                        + (f": its value is off by {named}" if named else ""),
                    )
                )
    return findings


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
