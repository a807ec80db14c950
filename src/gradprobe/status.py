"""Gradient status of many parameters at once: batched reductions, one host sync per device.

Statuses are ``none`` (no gradient), ``zero`` (exactly zero), ``nonzero``, ``nan``, ``inf``. The
status is decided on the L1 norm (exact for zero and NaN; an infinite L1 norm is checked against the
largest absolute value, which never overflows); the recorded norm is the L1 norm accumulated in float32
or wider (an L2 norm of a 1e-30 float32 gradient reads as zero; 100,000 float16 ones sum to inf in
float16), and where even that overflows for finite values, the largest absolute value times the L1
norm of the gradient divided by it, multiplied in float64 on the host.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

NONE, ZERO, NONZERO, NAN, INF = "none", "zero", "nonzero", "nan", "inf"
STATUSES = (NONE, ZERO, NONZERO, NAN, INF)


def _dense(g: torch.Tensor) -> torch.Tensor:
    # Sparse gradients (nn.Embedding(sparse=True)) have no norm kernel; their stored values suffice.
    g = g.coalesce().values() if g.is_sparse else g
    # Complex gradients: judged on their modulus (a real tensor; the norm kernels want real dtypes here).
    return g.abs() if g.is_complex() else g


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype.is_complex:
        return torch.float64 if dtype == torch.complex128 else torch.float32
    return torch.float64 if dtype == torch.float64 else torch.float32


def reduce_grads(grads: Sequence[torch.Tensor | None]) -> tuple[list[str], list[float | None]]:
    """Status and L1 norm of each gradient (``None`` norm where there is no gradient).

    One pass of ``torch._foreach_norm(ord=1)`` per (device, dtype, layout) group, one copy to the host per
    device: the number of host syncs does not grow with the number of parameters. The status is read
    from the L1 norm itself: a sum of absolute values is exactly zero only when every value is zero
    (no underflow: it is never below its largest term), and NaN when any value is NaN. Only an
    infinite L1 norm is ambiguous (an inf, or a finite sum past the accumulation dtype's range); for
    those gradients alone the largest absolute value decides, at one more host sync.
    """
    statuses: list[str] = [NONE] * len(grads)
    norms: list[float | None] = [None] * len(grads)
    present = [i for i, g in enumerate(grads) if g is not None]
    keys = [(g.device, g.dtype, g.layout) for g in grads if g is not None]
    groups: dict[tuple[torch.device, torch.dtype, torch.layout], list[int]] = {}
    if keys and keys.count(keys[0]) == len(keys):  # the usual case: one device, one dtype, dense
        groups[keys[0]] = present
    else:
        for i, key in zip(present, keys, strict=True):
            groups.setdefault(key, []).append(i)
    per_device: dict[torch.device, list[tuple[list[int], torch.Tensor]]] = {}
    for (device, dtype, layout), idx in groups.items():
        tensors = [grads[i] for i in idx]
        if layout != torch.strided or dtype.is_complex:
            tensors = [_dense(g) for g in tensors]  # type: ignore[arg-type]
        l1 = torch.stack(torch._foreach_norm(tensors, 1, dtype=_accumulation_dtype(dtype)))  # type: ignore[arg-type]
        per_device.setdefault(device, []).append((idx, l1))
    overflow: list[int] = []
    for parts in per_device.values():
        # One device-to-host copy for all groups on this device, in the widest accumulation dtype
        # among them (a device holding float64 gradients supports float64).
        wide = max((p.dtype for _, p in parts), key=lambda d: torch.finfo(d).bits)
        host = torch.cat([p.to(wide) for _, p in parts]).cpu().tolist()
        offset = 0
        for idx, _ in parts:
            for i, v in zip(idx, host[offset : offset + len(idx)], strict=True):
                norms[i] = v
                if math.isinf(v):
                    overflow.append(i)
                else:
                    statuses[i] = status_of(v)
            offset += len(idx)
    again: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i in overflow:
        again.setdefault((grads[i].device, grads[i].dtype), []).append(i)  # type: ignore[union-attr]
    for idx in again.values():
        dense = [_dense(grads[i]) for i in idx]  # type: ignore[arg-type]
        amax = torch.stack([torch.linalg.vector_norm(g, math.inf) for g in dense])
        # A finite gradient whose L1 sum overflowed the accumulation dtype (10,000 float32 values of
        # 1e36): the norm is amax * sum(|g| / amax), the sum at most numel, multiplied on the host in
        # float64. No float64 kernel is needed on the device.
        ratio = torch.stack(
            [
                torch.linalg.vector_norm(
                    g / torch.where(a > 0, a, 1).to(g.dtype), 1, dtype=_accumulation_dtype(g.dtype)
                )
                for g, a in zip(dense, amax, strict=True)
            ]
        )
        for i, a, r in zip(idx, amax.cpu().tolist(), ratio.cpu().tolist(), strict=True):
            statuses[i] = status_of(a)
            if math.isfinite(a):
                norms[i] = a * r  # inf only past float64's range
    return statuses, norms


def status_of(max_abs: float) -> str:
    """The status implied by a gradient's largest absolute value."""
    if math.isnan(max_abs):
        return NAN
    if math.isinf(max_abs):
        return INF
    return ZERO if max_abs == 0.0 else NONZERO
