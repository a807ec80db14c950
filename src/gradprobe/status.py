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
import operator
from collections.abc import Sequence

import torch

NONE, ZERO, NONZERO, NAN, INF = "none", "zero", "nonzero", "nan", "inf"
STATUSES = (NONE, ZERO, NONZERO, NAN, INF)

Grads = Sequence[torch.Tensor | None]
Read = tuple[list[str], list[float | None]]  # statuses and norms, in parameter order


def status_of(max_abs: float) -> str:
    """The status implied by a gradient's largest absolute value (or its L1 norm: zero, NaN and
    infinite alike). Every status is decided here."""
    if math.isnan(max_abs):
        return NAN
    if math.isinf(max_abs):
        return INF
    return ZERO if max_abs == 0.0 else NONZERO


def reduce_grads(grads: Grads) -> Read:
    """Status and L1 norm of each gradient (``None`` norm where there is no gradient).

    A sum of absolute values is exactly zero only when every value is zero (no underflow: it is never
    below its largest term), and NaN when any value is NaN. Only an infinite L1 norm is ambiguous (an
    inf, or a finite sum past the accumulation dtype's range); for those gradients alone the largest
    absolute value decides, at one more host sync.
    """
    (result,), _ = read([grads])
    return result


def read(lists: Sequence[Grads], extra: torch.Tensor | None = None) -> tuple[list[Read], list[float] | None]:
    """(statuses, norms) of each gradient list, and ``extra`` (a 1-D float tensor, e.g. the term
    values) as floats: one ``_foreach_norm`` per (device, dtype, layout) over all the lists, one
    device-to-host copy per device. The number of host syncs does not grow with the parameters."""
    # Per (device, dtype, layout): the (list, parameter indices) segments it holds.
    groups: dict[_Key, list[tuple[int, list[int]]]] = {}
    for k, grads in enumerate(lists):
        for key, idx in _groups(grads).items():
            groups.setdefault(key, []).append((k, idx))
    per_device: dict[torch.device, list[tuple[list[tuple[int, list[int]]], torch.Tensor]]] = {}
    for (device, dtype, layout, shape), segments in groups.items():
        tensors = [lists[k][i] for k, idx in segments for i in idx]
        acc = _accumulation_dtype(dtype)
        if shape is not None:  # many small gradients of one shape: see _STACKED
            norms = torch.linalg.vector_norm(
                torch.stack(tensors).reshape(len(tensors), -1), 1, dim=1, dtype=acc
            )  # type: ignore[arg-type]
        else:
            if layout != torch.strided or dtype.is_complex:
                tensors = [_dense(g) for g in tensors]  # type: ignore[arg-type]
            norms = torch.stack(torch._foreach_norm(tensors, 1, dtype=acc))  # type: ignore[arg-type]
        per_device.setdefault(device, []).append((segments, norms))
    if extra is not None:
        per_device.setdefault(extra.device, []).append(([], extra))
    out: list[Read] = [([NONE] * len(grads), [None] * len(grads)) for grads in lists]
    extra_host: list[float] | None = None
    for parts in per_device.values():
        # One copy to the host per device, in the widest dtype among the parts (a device holding
        # float64 tensors supports float64).
        wide = max((t.dtype for _, t in parts), key=_bits)
        host = torch.cat([t.to(wide) for _, t in parts]).cpu().tolist()
        at = 0
        for segments, t in parts:
            if not segments:  # ``extra``
                extra_host = host[at : at + t.numel()]
                at += t.numel()
            for k, idx in segments:
                (statuses, norms), mine = out[k], host[at : at + len(idx)]
                at += len(idx)
                if len(idx) == len(norms):  # every parameter has a gradient here: idx is 0..n-1
                    norms[:], statuses[:] = mine, map(status_of, mine)
                    continue
                for i, v in zip(idx, mine, strict=True):
                    norms[i], statuses[i] = v, status_of(v)
    for grads, (statuses, norms) in zip(lists, out, strict=True):
        if math.inf in norms:  # an inf, or a finite sum past the accumulation dtype: rechecked
            _recheck_overflow(grads, [i for i, v in enumerate(norms) if v == math.inf], statuses, norms)
    return out, extra_host


# A group of (device, dtype, layout), and the shape of its gradients where they are stacked (else None).
_Key = tuple[torch.device, torch.dtype, torch.layout, torch.Size | None]

# The one special path, measured on 8,192 parameter tensors of 4 and 16 elements (benchmarks/
# other_models.py's tiny blocks, one thread): ``_foreach_norm`` launches a norm per tensor, 14 ms for
# all of them (plus 6 ms to stack its 0-dim results), while one stack and one norm per shape take
# ~2 ms. Only small real gradients, 16 or more of a shape, are stacked: the copy is small.
_STACKED = (16, 4096)  # at least this many gradients of a shape, of at most this many elements each


def _groups(grads: Grads) -> dict[_Key, list[int]]:
    """Indices of the present gradients per (device, dtype, layout), split by shape where stacked."""
    present = [i for i, g in enumerate(grads) if g is not None]
    if not present:
        return {}
    tensors = grads if len(present) == len(grads) else [grads[i] for i in present]
    devices, dtypes, layouts = (
        set(map(_DEVICE, tensors)),
        set(map(_DTYPE, tensors)),
        set(map(_LAYOUT, tensors)),
    )
    if len(devices) == len(dtypes) == len(layouts) == 1:  # the usual case, found at C speed
        groups = {(devices.pop(), dtypes.pop(), layouts.pop()): present}
    else:
        groups = {}
        for i in present:
            g = grads[i]
            groups.setdefault((g.device, g.dtype, g.layout), []).append(i)  # type: ignore[union-attr]
    out: dict[_Key, list[int]] = {}
    for (device, dtype, layout), idx in groups.items():
        if layout != torch.strided or dtype.is_complex or len(idx) < _STACKED[0]:
            out[device, dtype, layout, None] = idx
            continue
        by_shape: dict[torch.Size, list[int]] = {}
        for i in idx:
            by_shape.setdefault(grads[i].shape, []).append(i)  # type: ignore[union-attr]
        for shape, members in by_shape.items():
            stacked = len(members) >= _STACKED[0] and 0 < shape.numel() <= _STACKED[1]
            out.setdefault((device, dtype, layout, shape if stacked else None), []).extend(members)
    return out


def _dense(g: torch.Tensor) -> torch.Tensor:
    # Sparse gradients (nn.Embedding(sparse=True)) have no norm kernel; their stored values suffice.
    g = g.coalesce().values() if g.is_sparse else g
    # Complex gradients: judged on their modulus (a real tensor; the norm kernels want real dtypes here).
    return g.abs() if g.is_complex() else g


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype.is_complex:
        return torch.float64 if dtype == torch.complex128 else torch.float32
    return torch.float64 if dtype == torch.float64 else torch.float32


def _recheck_overflow(
    grads: Grads, overflow: list[int], statuses: list[str], norms: list[float | None]
) -> None:
    """Statuses and norms of the gradients whose L1 norm came out infinite, from their largest absolute
    value (one more host sync per device and dtype)."""
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


_BITS: dict[torch.dtype, int] = {}


def _bits(dtype: torch.dtype) -> int:
    bits = _BITS.get(dtype)
    if bits is None:
        bits = _BITS[dtype] = torch.finfo(dtype).bits
    return bits


_DEVICE = operator.attrgetter("device")
_DTYPE = operator.attrgetter("dtype")
_LAYOUT = operator.attrgetter("layout")
