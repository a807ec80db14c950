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
# "tf32": float32 on CUDA with TF32 matrix products on (``precision``): a 10-bit mantissa, as float16's.
DEFAULT_RTOL = {"float64": 1e-7, "float32": 1e-3, "tf32": 1e-2, "bfloat16": 5e-2, "float16": 1e-2}


def precision(parameter: torch.Tensor) -> str:
    """The precision the probe's gradients are computed in: the parameter's dtype, or ``"tf32"`` for
    float32 on CUDA while torch runs float32 matrix products in TF32 (``allow_tf32`` or
    ``set_float32_matmul_precision("high"/"medium")``). Measured on an H200 with TF32 on: make_fx and
    eager gradients of the zoo potential differ by up to 3e-3 relative L1, a float32 tolerance's
    false alarm. TF32 convolutions (``cudnn.allow_tf32``) are not counted: not measured here."""
    dtype = str(parameter.dtype).removeprefix("torch.")
    if dtype == "float32" and parameter.device.type == "cuda" and tf32_matmuls():
        return "tf32"
    return dtype


def tf32_matmuls() -> bool:
    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


# Autocast levels, loosest last: float16's tolerance (1e-2) is tighter than bfloat16's (5e-2).
LEVELS = ("off", "fp16", "bf16")


def loosest(*levels: str) -> str:
    """The level whose tolerance governs a comparison of paths computing at these levels."""
    return max(levels, key=lambda level: LEVELS.index(level) if level in LEVELS else 0)


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


# Noise floor, relative to the run's gradient scale (the largest mean |gradient| of any parameter in
# the reference run): below it a non-zero gradient is rounding noise of an analytically zero one
# (attention key biases come out at ~1e-11 of the scale in float64), not a reached parameter.
NOISE_FLOOR = {"float64": 1e-9, "float32": 1e-5, "tf32": 1e-5, "bfloat16": 1e-2, "float16": 1e-2}


def noise_floor(norms: Sequence[float | None], numels: Sequence[int], dtype: str) -> float:
    """The mean |gradient| per element below which a gradient counts as noise in this run."""
    means = [n / k for n, k in zip(norms, numels, strict=True) if n is not None and k and math.isfinite(n)]
    scale = max(means, default=0.0)
    return NOISE_FLOOR.get(dtype, 1e-5) * scale


def negligible(status: str, norm: float | None, numel: int, floor: float) -> bool:
    """Exact zero, no gradient, or a non-zero gradient below the noise floor."""
    if status != NONZERO:
        return status in ("none", "zero")
    return norm is not None and numel > 0 and norm / numel <= floor


def noise_pairs(
    ref_statuses: Sequence[str],
    ref_norms: Sequence[float | None],
    statuses: Sequence[str],
    norms: Sequence[float | None],
    numels: Sequence[int],
    dtype: str,
) -> list[tuple[bool, bool]]:
    """Per parameter of one run: (reference at noise level, variant at noise level), against the noise
    floor of the reference run (the ``noise`` argument of ``verdict``)."""
    floor = noise_floor(ref_norms, numels, dtype)
    return [
        (negligible(rs, rn, k, floor), negligible(s, n, k, floor))
        for rs, rn, s, n, k in zip(ref_statuses, ref_norms, statuses, norms, numels, strict=True)
    ]


def verdict(
    ref_status: str,
    status: str,
    rel_error: float | None,
    rtol: float,
    noise: tuple[bool, bool] = (False, False),
) -> str:
    """match / missing / extra / wrong for one cell, judged on non-zero and on values.

    ``noise`` says whether the reference's and the variant's gradients are below the run's noise floor
    (``negligible``): two gradients at noise level match whatever their relative error, and a
    gradient at noise level against a real one counts as not reached.
    """
    ref_noise, var_noise = noise
    if (
        ref_noise
        and var_noise
        and ref_status in (NONZERO, "zero", "none")
        and status in (NONZERO, "zero", "none")
    ):
        return MATCH
    ref_reached = ref_status == NONZERO and not ref_noise
    reached = status == NONZERO and not var_noise
    if ref_reached and not reached:
        return WRONG if status in ("nan", "inf") else MISSING
    if reached and not ref_reached:
        return EXTRA
    if status != ref_status and (status in ("nan", "inf") or ref_status in ("nan", "inf")):
        return WRONG
    if reached and ref_reached and rel_error is not None and not rel_error <= rtol:
        return WRONG
    return MATCH


def judge(
    ref_statuses: Sequence[str],
    ref_norms: Sequence[float | None],
    statuses: Sequence[str],
    norms: Sequence[float | None],
    rel_errors: Sequence[float | None],
    numels: Sequence[int],
    dtype: str,
    rtol: float,
) -> list[str]:
    """The verdict of every parameter of one run against the reference's run of the same scenario: the
    relative L1 error against that parameter's reference gradient at ``rtol``, with the reference run's
    noise floor (``noise_pairs``). What the flow map's cells record (at the table's ``tolerance``) and
    what the consistency check reads (at its tighter ``consistency_tolerance``)."""
    noise = noise_pairs(ref_statuses, ref_norms, statuses, norms, numels, dtype)
    return [
        verdict(rs, st, e, rtol, nz)
        for rs, st, e, nz in zip(ref_statuses, statuses, rel_errors, noise, strict=True)
    ]


# The consistency check's relative L1 error per parameter, by dtype: tighter than the table's
# (``DEFAULT_RTOL``): float64 reaches 1e-10 between correct paths. The same measure as the cells', the
# same noise floor: a cell the table calls wrong fails the consistency check too.
CONSISTENCY_RTOL = {"float64": 1e-10, "float32": 1e-5, "tf32": 5e-3, "bfloat16": 2e-2, "float16": 5e-3}


def consistency_tolerance(dtype: str, autocast: str = "off") -> float:
    """The consistency check's rtol: the relative L1 error per parameter above which a path is not
    consistent with the reference (never looser than the table's ``tolerance``)."""
    computed = {"bf16": "bfloat16", "fp16": "float16"}.get(autocast, dtype)
    return min(CONSISTENCY_RTOL.get(computed, 1e-5), tolerance(dtype, autocast))


def _squared_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Squared L2 norms, accumulated in float64 by the batched kernel, per (device, dtype) group."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return [n * n for ts in groups.values() for n in torch._foreach_norm(ts, 2, dtype=torch.float64)]


def cosine_and_scale(
    grads: Sequence[torch.Tensor | None], reference: Sequence[torch.Tensor | None]
) -> tuple[float | None, float | None]:
    """Cosine between the two gradient vectors (all parameters at once) and the ratio of their L2
    norms; a missing gradient counts as zeros. One batched reduction and one host sync."""
    dots: list[torch.Tensor] = []
    own: list[torch.Tensor] = []
    ref: list[torch.Tensor] = []
    for g, r in zip(grads, reference, strict=True):
        g = _real(_dense(g)) if g is not None else None
        r = _real(_dense(r)) if r is not None else None
        if g is not None and r is not None:
            dots.append((g * r).sum(dtype=torch.float64))
        if g is not None:
            own.append(g)
        if r is not None:
            ref.append(r)
    # Squared L2 norms accumulated in float64 by the batched kernel (no copies of the gradients).
    own, ref = _squared_norms(own), _squared_norms(ref)
    parts = [x for x in (dots, own, ref) if x]
    if not parts:
        return None, None
    device = parts[0][0].device

    def total(xs: list[torch.Tensor]) -> torch.Tensor:
        return (
            torch.stack([x.to(device) for x in xs]).sum()
            if xs
            else torch.zeros((), dtype=torch.float64, device=device)
        )

    dot, g2, r2 = torch.stack([total(dots), total(own), total(ref)]).cpu().tolist()
    if not (math.isfinite(g2) and math.isfinite(r2) and math.isfinite(dot)):
        return None, None
    scale = math.sqrt(g2 / r2) if r2 > 0 else (0.0 if g2 == 0 else math.inf)
    cosine = dot / math.sqrt(g2 * r2) if g2 > 0 and r2 > 0 else None
    return cosine, scale
