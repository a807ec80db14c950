"""Comparing a variant's gradients with the reference variant's, value by value.

Per parameter: the relative error ``|g - g_ref|_1 / |g_ref|_1`` (L1, like the recorded norm), and a
verdict telling apart *missing* (the reference reaches it, the variant does not), *extra* (the other
way round) and *wrong* (both reach it, values differ beyond the tolerance for the dtype). Counting
non-zero gradients alone misses most breakage: a traced force term on torch 2.13 loses 2 parameters
and gets 7 others wrong on the reference potential.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .status import NONZERO

MATCH, MISSING, EXTRA, WRONG = "match", "missing", "extra", "wrong"
VERDICTS = (MATCH, MISSING, EXTRA, WRONG)

# Relative L1 error above which values count as wrong, by the dtype gradients are computed in.
# Loose enough for reassociation by compilers, tight enough that a dropped path always shows.
DEFAULT_RTOL = {"float64": 1e-7, "float32": 1e-3, "bfloat16": 5e-2, "float16": 1e-2}


def tolerance(dtype: str, autocast: str = "off") -> float:
    if autocast == "bf16":
        return DEFAULT_RTOL["bfloat16"]
    if autocast == "fp16":
        return DEFAULT_RTOL["float16"]
    return DEFAULT_RTOL.get(dtype, 1e-3)


def relative_errors(
    grads: Sequence[torch.Tensor | None],
    reference: Sequence[torch.Tensor | None],
    reference_norms: Sequence[float | None],
) -> list[float | None]:
    """Relative L1 error of each gradient against the reference; None where both have no gradient.

    A missing gradient counts as zeros. One batched reduction and one host sync per device.
    """
    out: list[float | None] = [None] * len(grads)
    both: list[int] = []
    for i, (g, r) in enumerate(zip(grads, reference, strict=True)):
        if g is None and r is None:
            continue
        if g is None:
            out[i] = 1.0 if (reference_norms[i] or 0.0) > 0 else 0.0
        elif r is None:
            both.append(i)  # |g| / 0: computed below from |g|
        else:
            both.append(i)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i in both:
        g = grads[i]
        assert g is not None
        groups.setdefault((g.device, g.dtype), []).append(i)
    for (_, dtype), idx in groups.items():
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        diffs = [
            _real(_dense(grads[i]) if reference[i] is None else _dense(grads[i]) - _dense(reference[i]))  # type: ignore[operator]
            for i in idx
        ]
        acc = torch.float64 if diffs[0].dtype == torch.float64 else torch.float32
        l1 = torch.stack(torch._foreach_norm(diffs, 1, dtype=acc)).cpu().tolist()
        for i, d in zip(idx, l1, strict=True):
            ref = reference_norms[i] or 0.0
            out[i] = _ratio(d, ref)
    return out


def _dense(g: torch.Tensor) -> torch.Tensor:
    return g.to_dense() if g.is_sparse else g


def _real(d: torch.Tensor) -> torch.Tensor:
    """The modulus of a complex difference (the norm kernels want real dtypes)."""
    return d.abs() if d.is_complex() else d


def _ratio(diff: float, ref: float) -> float:
    if math.isnan(diff) or math.isnan(ref):
        return math.nan
    if ref == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / ref


def verdict(ref_status: str, status: str, rel_error: float | None, rtol: float) -> str:
    """match / missing / extra / wrong for one cell, judged on non-zero and on values."""
    ref_reached, reached = ref_status == NONZERO, status == NONZERO
    if ref_reached and not reached:
        return WRONG if status in ("nan", "inf") else MISSING
    if reached and not ref_reached:
        return EXTRA
    if status != ref_status and (status in ("nan", "inf") or ref_status in ("nan", "inf")):
        return WRONG
    if reached and rel_error is not None and not rel_error <= rtol:
        return WRONG
    return MATCH


# Consistency (allclose) tolerances by dtype: float64 reaches 1e-10 between correct paths.
CONSISTENCY_TOL = {
    "float64": (1e-10, 1e-10),
    "float32": (1e-5, 1e-6),
    "bfloat16": (2e-2, 1e-3),
    "float16": (5e-3, 1e-4),
}


def consistency_tolerance(dtype: str) -> tuple[float, float]:
    """(rtol, atol) for the allclose-style consistency check."""
    return CONSISTENCY_TOL.get(dtype, (1e-5, 1e-6))


def allclose_excess(
    grads: Sequence[torch.Tensor | None], reference: Sequence[torch.Tensor | None], rtol: float
) -> list[float | None]:
    """Per parameter, ``max(|g - r| - rtol * |r|)`` over elements (``<= atol`` means allclose); a missing
    gradient counts as zeros, None where both are missing. Batched, one host sync per device."""
    out: list[float | None] = [None] * len(grads)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (g, r) in enumerate(zip(grads, reference, strict=True)):
        t = g if g is not None else r
        if t is not None:
            groups.setdefault((t.device, t.dtype), []).append(i)
    for idx in groups.values():
        diffs, scaled = [], []
        for i in idx:
            g, r = grads[i], reference[i]
            g = _dense(g) if g is not None else torch.zeros_like(_dense(r))  # type: ignore[arg-type]
            r = _dense(r) if r is not None else torch.zeros_like(g)
            diffs.append(_real(g - r))
            scaled.append(_real(r))
        torch._foreach_abs_(diffs)
        scaled = torch._foreach_abs(scaled)
        torch._foreach_mul_(scaled, rtol)
        torch._foreach_sub_(diffs, scaled)
        worst = (
            torch.stack([d.max() if d.numel() else d.new_zeros(()) for d in diffs]).double().cpu().tolist()
        )
        for i, w in zip(idx, worst, strict=True):
            out[i] = w
    return out
