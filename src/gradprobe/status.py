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
from itertools import repeat

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
    (result,), _ = read([Stacking(grads).stack(grads)])
    return result


# The one special path: small gradients of one shape stacked into one tensor. On 8,192 parameter
# tensors of 4 and 16 elements (benchmarks/other_models.py's tiny blocks, one thread, CPU)
# ``_foreach_norm`` takes ~14 ms over them (a norm per tensor, then a stack of the 0-dim results) and
# ``_foreach_add`` ~18 ms per sum of two terms' gradients; a stack takes ~3 ms, after which a norm or a
# sum is one call per shape. Probe / floor (one forward + k autograd.grad), medians of 7 interleaved
# rounds: about 1.18x with neither stacked, 1.04-1.27x with norms stacked and sums per tensor, 0.94-1.05x
# with both (0.81-1.08x before this rewrite); line 1.15x + 1 ms. See docs/benchmarks.md.
_STACK_MIN = 16  # gradients of one shape, at least, to be stacked
_STACK_NUMEL = 4096  # elements per gradient, at most: a stack is a copy of small gradients only


class Stacking:
    """Which gradients of a list are stacked: those of 16 or more small parameters of one (device,
    real floating dtype, shape). Decided once from the parameters (autograd hands back each gradient
    in its input's shape, dtype and device), it holds every gradient list of a probe the same way."""

    def __init__(self, tensors: Grads) -> None:
        self.size = len(tensors)
        self.groups: list[list[int]] = []  # indices into ``tensors``, one list per stack
        for (_, dtype, layout), idx in _kinds(tensors).items():
            if layout != torch.strided or not dtype.is_floating_point or len(idx) < _STACK_MIN:
                continue
            by_shape: dict[torch.Size, list[int]] = {}
            for i in idx:
                by_shape.setdefault(tensors[i].shape, []).append(i)  # type: ignore[union-attr]
            self.groups += [
                m
                for shape, m in by_shape.items()
                if len(m) >= _STACK_MIN and 0 < shape.numel() <= _STACK_NUMEL
            ]
        stacked = {i for m in self.groups for i in m}
        self.rest = [i for i in range(self.size) if i not in stacked]  # held one by one

    def stack(self, grads: Grads) -> Stacked:
        """``grads`` (one per parameter, None where there is none) held this way: the stacked groups
        copied into one tensor each (a zero standing in for a missing gradient; None where the whole
        group is missing), the rest as they are."""
        stacks: list[torch.Tensor | None] = []
        for idx in self.groups:
            members = [grads[i] for i in idx]
            if not all(map(operator.is_not, members, repeat(None))):
                present = [g for g in members if g is not None]
                if not present:
                    stacks.append(None)
                    continue
                zero = torch.zeros_like(present[0])
                members = [zero if g is None else g for g in members]
            if set(map(_LAYOUT, members)) != {torch.strided}:  # a sparse gradient of a dense parameter
                members = [g.to_dense() for g in members]  # type: ignore[union-attr]
            stacks.append(torch.stack(members))  # type: ignore[arg-type]
        present = list(map(operator.is_not, grads, repeat(None)))
        return Stacked(self, stacks, [grads[i] for i in self.rest], present)


class Stacked:
    """One gradient list as a ``Stacking`` holds it: ``stacks`` (one per group), ``rest`` (the other
    gradients, in ``stacking.rest``'s order) and which parameters have a gradient (``present``)."""

    __slots__ = ("present", "rest", "stacking", "stacks")

    def __init__(
        self, stacking: Stacking, stacks: list[torch.Tensor | None], rest: Grads, present: list[bool]
    ) -> None:
        self.stacking, self.stacks, self.rest, self.present = stacking, stacks, rest, present

    def __add__(self, other: Stacked) -> Stacked:
        """The sum (None + g = g), never in place: a new tensor for every sum of two gradients."""
        stacks = [
            b if a is None else a if b is None else a + b
            for a, b in zip(self.stacks, other.stacks, strict=True)
        ]
        present = list(map(operator.or_, self.present, other.present))
        return Stacked(self.stacking, stacks, _add(self.rest, other.rest), present)

    def grads(self) -> list[torch.Tensor | None]:
        """One gradient per parameter (None where there is none); a stacked one is a view of its stack."""
        out: list[torch.Tensor | None] = [None] * self.stacking.size
        for idx, stacked in zip(self.stacking.groups, self.stacks, strict=True):
            if stacked is not None:
                for i, g in zip(idx, stacked.unbind(0), strict=True):
                    out[i] = g
        for i, g in zip(self.stacking.rest, self.rest, strict=True):
            out[i] = g
        return [g if p else None for g, p in zip(out, self.present, strict=True)]


def _add(a: Grads, b: Grads) -> list[torch.Tensor | None]:
    """``a + b`` gradient by gradient (None + g = g), never in place.

    A gradient entering an empty slot is held as it is, not copied: autograd may return a tensor
    someone else holds (a custom ``backward`` that hands back a saved tensor of the user's batch, the
    same tensor for two parameters, an expanded view), so nothing is ever written into one; a sum of
    two makes a new tensor (one batched add for the dense pairs; sparse + dense has no kernel, dense +
    sparse has: a dense tensor goes first).
    """
    out, both = list(a), []
    for i, g in enumerate(b):
        if g is not None:
            if out[i] is None:
                out[i] = g
            else:
                both.append(i)
    firsts, seconds = [out[i] for i in both], [b[i] for i in both]
    if firsts and set(map(_LAYOUT, firsts)) | set(map(_LAYOUT, seconds)) == {torch.strided}:
        sums = torch._foreach_add(firsts, seconds)  # type: ignore[arg-type]
    else:
        sums = [g + f if g.layout == torch.strided else f + g for f, g in zip(firsts, seconds, strict=True)]  # type: ignore[operator, union-attr]
    for i, total in zip(both, sums, strict=True):
        out[i] = total
    return out


def read(
    lists: Sequence[Stacked], extra: torch.Tensor | None = None
) -> tuple[list[Read], list[float] | None]:
    """(statuses, norms) of each gradient list, and ``extra`` (a 1-D float tensor, e.g. the term
    values) as floats: a norm per stack, one ``_foreach_norm`` per (device, dtype, layout) of the
    rest, then one device-to-host copy per device. The number of host syncs does not grow with the
    parameters."""
    # Per device: (list, parameter indices, their L1 norms); ``extra`` with no list (-1).
    parts: dict[torch.device, list[tuple[int, list[int], torch.Tensor]]] = {}
    for k, x in enumerate(lists):
        for idx, stacked in zip(x.stacking.groups, x.stacks, strict=True):
            if stacked is not None:
                acc = _accumulation_dtype(stacked.dtype)
                norms = torch.linalg.vector_norm(stacked.reshape(len(idx), -1), 1, dim=1, dtype=acc)
                parts.setdefault(stacked.device, []).append((k, idx, norms))
        for (device, dtype, layout), at in _kinds(x.rest).items():
            tensors = [x.rest[j] for j in at]
            if layout != torch.strided or dtype.is_complex:
                tensors = [_dense(g) for g in tensors]  # type: ignore[arg-type]
            norms = torch.stack(torch._foreach_norm(tensors, 1, dtype=_accumulation_dtype(dtype)))  # type: ignore[arg-type]
            parts.setdefault(device, []).append((k, [x.stacking.rest[j] for j in at], norms))
    if extra is not None:
        parts.setdefault(extra.device, []).append((-1, [], extra))
    out: list[Read] = [([NONE] * x.stacking.size, [None] * x.stacking.size) for x in lists]
    extra_host: list[float] | None = None
    for on_device in parts.values():
        # One copy to the host per device, in the widest dtype among the parts (a device holding
        # float64 tensors supports float64).
        wide = max((t.dtype for _, _, t in on_device), key=_bits)
        both = [t.to(wide) for _, _, t in on_device]
        host = (both[0] if len(both) == 1 else torch.cat(both)).cpu().tolist()
        at = 0
        for k, idx, t in on_device:
            values = host[at : at + t.numel()]
            at += t.numel()
            if k < 0:
                extra_host = values
                continue
            statuses, norms = out[k]
            for i, v in zip(idx, values, strict=True):
                norms[i], statuses[i] = v, status_of(v)
    for x, (statuses, norms) in zip(lists, out, strict=True):
        if not all(x.present):  # a zero stood in for these in a stack
            for i in [i for i, p in enumerate(x.present) if not p]:
                statuses[i], norms[i] = NONE, None
        if math.inf in norms:  # an inf, or a finite sum past the accumulation dtype: rechecked
            _recheck_overflow(x.grads(), [i for i, v in enumerate(norms) if v == math.inf], statuses, norms)
    return out, extra_host


def _kinds(tensors: Grads) -> dict[tuple[torch.device, torch.dtype, torch.layout], list[int]]:
    """Indices of the present tensors per (device, dtype, layout)."""
    present = [i for i, g in enumerate(tensors) if g is not None]
    if not present:
        return {}
    given = tensors if len(present) == len(tensors) else [tensors[i] for i in present]
    devices, dtypes, layouts = set(map(_DEVICE, given)), set(map(_DTYPE, given)), set(map(_LAYOUT, given))
    if len(devices) == len(dtypes) == len(layouts) == 1:  # the usual case, found at C speed
        return {(devices.pop(), dtypes.pop(), layouts.pop()): present}
    kinds: dict[tuple[torch.device, torch.dtype, torch.layout], list[int]] = {}
    for i in present:
        g = tensors[i]
        kinds.setdefault((g.device, g.dtype, g.layout), []).append(i)  # type: ignore[union-attr]
    return kinds


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
