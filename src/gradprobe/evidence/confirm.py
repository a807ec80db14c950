"""Finite-difference confirmation of dependence that left torch.

A value that leaves torch as a Python number or a NumPy array (``.item()``, ``float()``, ``.tolist()``,
``.numpy()``) cannot be followed by the lineage recorder. Before a term is blamed for depending on
parameters only through such a site, its value is measured with those parameters moved by ``±δ``: the
antisymmetric part ``(t(+δ) - t(-δ)) / 2`` is first order (second-order effects cancel), and it must
stand well above the run-to-run noise of the term, measured by running the path twice unperturbed.
Parameters are restored bit for bit from copies after each trial.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

# Relative step of each perturbed tensor (times its RMS, or 1e-3 for a tensor of zeros), and the
# relative change of the term below which a change is not trusted, by the parameters' dtype.
STEP = 1e-3
MIN_CHANGE = {torch.float64: 1e-9, torch.float32: 1e-5}
NOISE_FACTOR = 100.0


def confirm(
    values: Callable[[], Mapping[str, float]],
    params: Mapping[str, torch.Tensor],
    candidates: Sequence[tuple[str, Sequence[str], Sequence[str]]],
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Which terms change when each candidate's parameters move.

    ``values()`` runs the path once and returns its term values; ``candidates`` are
    ``(key, parameter names, term names)``. Returns per candidate the first-order change of each
    term, the noise, and ``confirmed``: the terms whose change stands above both thresholds.
    """
    if not candidates:
        return []
    base_a, base_b = values(), values()
    out = []
    gen = torch.Generator().manual_seed(seed)
    for key, names, terms in candidates:
        tensors = [params[n] for n in names if n in params]
        if not tensors:
            continue
        saved = [t.detach().clone() for t in tensors]
        steps = []
        for t in tensors:
            rms = float(t.detach().double().pow(2).mean().sqrt()) if t.numel() else 0.0
            direction = torch.randint(0, 2, t.shape, generator=gen).to(t.device, t.dtype) * 2 - 1
            steps.append(direction * (STEP * (rms if rms > 0 else 1e-3)))
        try:
            plus = _moved(values, tensors, saved, steps, 1.0)
            minus = _moved(values, tensors, saved, steps, -1.0)
        finally:
            with torch.no_grad():
                for t, s in zip(tensors, saved, strict=True):
                    t.copy_(s)
        floor = MIN_CHANGE.get(tensors[0].dtype, 1e-4)
        changes, confirmed = {}, []
        for term in terms:
            a, b = base_a.get(term), base_b.get(term)
            p, m = plus.get(term), minus.get(term)
            if None in (a, b, p, m) or not all(math.isfinite(x) for x in (a, b, p, m)):  # type: ignore[arg-type]
                continue
            first = (p - m) / 2  # type: ignore[operator]
            noise = abs(a - b)  # type: ignore[operator]
            changes[term] = {"change": first, "noise": noise, "value": a}
            if abs(first) > max(NOISE_FACTOR * noise, floor * max(abs(a), 1e-30)):  # type: ignore[arg-type]
                confirmed.append(term)
        out.append({"key": key, "parameters": list(names), "changes": changes, "confirmed": confirmed})
    return out


def _moved(
    values: Callable[[], Mapping[str, float]],
    tensors: list[torch.Tensor],
    saved: list[torch.Tensor],
    steps: list[torch.Tensor],
    sign: float,
) -> Mapping[str, float]:
    with torch.no_grad():
        for t, s, d in zip(tensors, saved, steps, strict=True):
            t.copy_(s + sign * d)
    return values()
