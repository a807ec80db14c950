"""Gathering diagnosis evidence inside a probe: bisect the knobs of failing variants, locate where the
chain breaks in the model. Both re-use the probe's reference gradients and re-measure only the
scenarios that fail."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .bisect import bisect
from .build import VariantContext, build
from .compare import tolerance, verdict
from .measure import Measurement, per_scenario
from .scenarios import Scenario
from .spec import ProbeSpec
from .status import INF, NAN
from .step import make_weights
from .variants import VariantSpec


def _mismatch(m: Measurement, ref: Measurement | None, rtol: float) -> bool:
    """The run differs from the reference: an error where the reference ran, or any cell not matching."""
    if m.error is not None:
        return ref is None or ref.error is None
    if ref is None or ref.statuses is None or m.statuses is None:
        return False
    rel = m.rel_errors or [None] * len(m.statuses)
    return any(
        verdict(r, s, e, rtol) != "match" for r, s, e in zip(ref.statuses, m.statuses, rel, strict=True)
    )


def bisect_failing(
    spec: ProbeSpec,
    model: torch.nn.Module,
    params: list[torch.Tensor],
    mode: str,
    terms: list[str],
    scenarios: Sequence[Scenario],
    batch: Any,
    measured: Sequence[Any],
    ref_results: Mapping[str, Measurement],
    ref_name: str,
    dtype: str,
    model_training: bool,
) -> list[dict[str, Any]]:
    """One bisection per variant that fails where the reference does not (or per failing reference)."""
    by_name = {s.name: s for s in scenarios}
    out = []
    for x in measured:
        if x.variant.capture == "user" and not x.variant.user_knobs:
            continue  # a user variant without declared knobs has nothing gradprobe can flip
        rtol = tolerance(dtype, x.variant.knobs.get("autocast", "off"))
        is_ref = x.info.name == ref_name
        if is_ref:
            failing = [m.scenario for m in x.results if m.error is not None]
        else:
            failing = [m.scenario for m in x.results if _mismatch(m, ref_results.get(m.scenario), rtol)]
        if not failing:
            continue
        subset = [by_name[failing[0]]]  # one failing scenario re-measured per trial

        def check(v: VariantSpec, subset: list[Scenario] = subset, is_ref: bool = is_ref) -> tuple[bool, str]:
            ctx = VariantContext(model, spec.step, mode, terms, batch, make_weights(terms, terms, params[0]))
            built = build(v, ctx)
            if built.error is not None:
                return False, f"{built.error.stage} failed: {built.error.message}"
            results = per_scenario(
                lambda w, run=built.run: run(batch, w),  # type: ignore[misc]
                params, subset, terms, spec.seed,
                reference=None if is_ref else ref_results, counter=built.counter,
            )  # fmt: skip
            m = results[0]
            if m.error is not None:
                return False, f"{m.error.stage}: {m.error.message}"
            if is_ref:
                # Nothing to compare with: the flow is restored when the run works and reaches something.
                reached = sum(st == "nonzero" for st in m.statuses or [])
                return reached > 0, f"{reached} reached, no error"
            bad = _mismatch(m, ref_results.get(m.scenario), tolerance(dtype, v.knobs.get("autocast", "off")))
            reached = sum(st == "nonzero" for st in m.statuses or [])
            return not bad, f"{reached} reached" + (
                ", differs from the reference" if bad else ", matches the reference"
            )

        out.append(bisect(x.variant, failing[:1], check, model_training).to_dict())
    return out


def locate_in_model(
    spec: ProbeSpec, model: torch.nn.Module, mode: str, terms: list[str], batch: Any,
    ref_results: Mapping[str, Measurement],
) -> list[dict[str, Any]]:  # fmt: skip
    """Where parameter-dependent tensors stop carrying gradient in one instrumented eager step, and the
    first op whose backward produces NaN/Inf when a reference gradient is non-finite."""
    from .locate import locate_breaks, locate_nonfinite_backward

    weights = make_weights(terms, terms, next(model.parameters())) if mode == "weights" else None

    def call() -> Any:
        return spec.step(model, batch) if weights is None else spec.step(model, batch, weights)

    def term_values() -> Mapping[str, torch.Tensor]:
        out = call()
        return out[1] if isinstance(out, tuple) else out

    try:
        breaks = [b.to_dict() for b in locate_breaks(model, call)]
    except Exception as e:  # the locator is best effort: the measurement stands without it
        return [{"kind": "locate-failed", "op": type(e).__name__, "detail": str(e)[:300]}]
    nonfinite = [
        s
        for s, m in ref_results.items()
        if m.statuses is not None and any(st in (NAN, INF) for st in m.statuses)
    ]
    if nonfinite and mode == "terms":
        term = next((t for t in terms if f"{t} only" in nonfinite), terms[0])
        try:
            found = locate_nonfinite_backward(model, term_values, term)
        except Exception:
            found = None
        if found is not None:
            breaks.insert(0, found.to_dict())
    return breaks
