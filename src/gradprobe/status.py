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
from collections.abc import Callable, Sequence
from itertools import compress, repeat
from typing import Any

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

    The L1 norms of each (device, dtype, layout) group are taken in a few batched calls
    (``_l1_norms``), one copy to the host per device: the number of host syncs does not grow with
    the number of parameters. The status is read from the L1 norm itself: a sum of absolute values is
    exactly zero only when every value is zero (no underflow: it is never below its largest term), and
    NaN when any value is NaN. Only an infinite L1 norm is ambiguous (an inf, or a finite sum past the
    accumulation dtype's range); for those gradients alone the largest absolute value decides, at one
    more host sync.
    """
    (result,), _ = read([launch(grads)])
    return result


class Pending:
    """One list of gradients to reduce; ``read`` reduces many of them together (one batched norm
    per (device, dtype, layout) over all of them, one copy to the host per device)."""

    def __init__(self, grads: Sequence[torch.Tensor | None]) -> None:
        self.grads = grads


def launch(grads: Sequence[torch.Tensor | None]) -> Pending:
    """A reduction of ``grads`` (see ``reduce_grads``) for ``read`` to finish with others."""
    return Pending(grads)


def read(
    pending: Sequence[Pending], extra: torch.Tensor | None = None
) -> tuple[list[tuple[list[str], list[float | None]]], list[float] | None]:
    """(statuses, norms) of each pending reduction, and ``extra`` (a 1-D float tensor, e.g. term
    values) as floats: the norms of all of them in one batched call per (device, dtype, layout),
    one device-to-host copy per device."""
    # Per (device, dtype, layout): the (pending index, parameter indices) segments it holds.
    groups: dict[tuple[torch.device, torch.dtype, torch.layout], list[tuple[int, list[int]]]] = {}
    for k, p in enumerate(pending):
        for key, idx in _groups(p.grads).items():
            groups.setdefault(key, []).append((k, idx))
    per_device: dict[
        torch.device, list[tuple[list[tuple[int, list[int]]], torch.Tensor, list[int] | None]]
    ] = {}
    for (device, dtype, layout), segments in groups.items():
        tensors = [g for k, idx in segments for g in map(pending[k].grads.__getitem__, idx)]
        if layout != torch.strided or dtype.is_complex:
            tensors = [_dense(g) for g in tensors]  # type: ignore[arg-type]
        l1, at = _l1_norms(tensors, _accumulation_dtype(dtype))  # type: ignore[arg-type]
        per_device.setdefault(device, []).append((segments, l1, at))
    if extra is not None:
        per_device.setdefault(extra.device, []).append(([], extra, None))
    out = [([NONE] * len(p.grads), [None] * len(p.grads)) for p in pending]
    overflow: list[list[int]] = [[] for _ in pending]
    extra_host: list[float] | None = None
    for parts in per_device.values():
        # One device-to-host copy for all parts on this device, in the widest dtype among them (a
        # device holding float64 tensors supports float64).
        wide = max((t.dtype for _, t, _ in parts), key=_bits)
        both = parts[0][1].to(wide) if len(parts) == 1 else torch.cat([t.to(wide) for _, t, _ in parts])
        host = both.cpu().tolist()
        offset = 0
        for segments, t, at in parts:
            group = host[offset : offset + t.numel()]
            offset += t.numel()
            if t is extra and not segments:
                extra_host = group
                continue
            if at is not None:  # back in the order of the segments' tensors
                group = [group[at[0]]] if len(at) == 1 else list(operator.itemgetter(*at)(group))
            start = 0
            for k, idx in segments:
                values = group[start : start + len(idx)]
                start += len(idx)
                statuses, norms = out[k]
                decided, _ = judged(values, None)  # every value here is a present gradient's
                if len(idx) == len(norms):  # every parameter has a gradient: idx is 0..n-1
                    norms[:] = values
                    statuses[:] = decided
                else:
                    for i, v, st in zip(idx, values, decided, strict=True):
                        norms[i] = v
                        statuses[i] = st
                if _INF in values:  # an inf, or a finite sum past the accumulation dtype: rechecked
                    overflow[k] += [i for i, v in zip(idx, values, strict=True) if v == _INF]
    for p, (statuses, norms), over in zip(pending, out, overflow, strict=True):
        if over:
            _recheck_overflow(p.grads, over, statuses, norms)
    return out, extra_host


_INF = math.inf
_ZERO = 0.0
_BITS: dict[torch.dtype, int] = {}


def _bits(dtype: torch.dtype) -> int:
    bits = _BITS.get(dtype)
    if bits is None:
        bits = _BITS[dtype] = torch.finfo(dtype).bits
    return bits


_DEVICE = operator.attrgetter("device")
_DTYPE = operator.attrgetter("dtype")
_LAYOUT = operator.attrgetter("layout")


def _groups(
    grads: Sequence[torch.Tensor | None],
) -> dict[tuple[torch.device, torch.dtype, torch.layout], list[int]]:
    """Indices of the present gradients per (device, dtype, layout)."""
    present = [i for i, g in enumerate(grads) if g is not None]
    if not present:
        return {}
    tensors = grads if len(present) == len(grads) else [grads[i] for i in present]
    # The usual case, tested at C speed: one device, one dtype, dense.
    devices, dtypes, layouts = (
        set(map(_DEVICE, tensors)),
        set(map(_DTYPE, tensors)),
        set(map(_LAYOUT, tensors)),
    )
    if len(devices) == len(dtypes) == len(layouts) == 1:
        return {(devices.pop(), dtypes.pop(), layouts.pop()): present}
    groups: dict[tuple[torch.device, torch.dtype, torch.layout], list[int]] = {}
    for i in present:
        g = grads[i]
        groups.setdefault((g.device, g.dtype, g.layout), []).append(i)  # type: ignore[union-attr]
    return groups


# Gradients of at most this many elements that share a shape are stacked and reduced in one call:
# ``torch._foreach_norm`` costs about 3 us per tensor on the CPU (a norm kernel launched per tensor),
# a stack about a tenth of that. Bigger ones go through ``_foreach_norm`` (no copy of big tensors).
_STACKED_NUMEL = 4096
_STACK_ELEMENTS = 1 << 22  # elements per stacked chunk: bounds the copy's memory
_STACK_MIN = 16  # gradients of one shape worth a stack of their own


def _l1_norms(tensors: list[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, list[int] | None]:
    """The L1 norm of each of ``tensors`` (same device, dtype and layout), accumulated in ``dtype``:
    ``(norms, at)``, the norm of ``tensors[j]`` being ``norms[at[j]]`` (``at`` None: ``norms[j]``)."""
    if len(tensors) < _STACK_MIN:
        return torch.stack(torch._foreach_norm(tensors, 1, dtype=dtype)), None
    chunks, single = _shape_groups(tensors)
    if not chunks:  # no group worth a stack
        return torch.stack(torch._foreach_norm(tensors, 1, dtype=dtype)), None
    order: list[int] = []
    parts: list[torch.Tensor] = []
    for chunk, shape in chunks:
        stacked = torch.stack([tensors[j] for j in chunk]).reshape(len(chunk), shape.numel())
        parts.append(torch.linalg.vector_norm(stacked, 1, dim=1, dtype=dtype))
        order.extend(chunk)
    if single:
        parts.append(torch.stack(torch._foreach_norm([tensors[j] for j in single], 1, dtype=dtype)))
        order.extend(single)
    norms = parts[0] if len(parts) == 1 else torch.cat(parts)
    # The position of each tensor's norm (``order``'s inverse, sorted in C), applied on the host: an
    # index tensor for a gather on the device would be a copy from the host, which syncs on a GPU.
    return norms, sorted(range(len(order)), key=order.__getitem__)


def _shape_groups(tensors: Sequence[torch.Tensor]) -> tuple[list[tuple[list[int], torch.Size]], list[int]]:
    """The indices of ``tensors`` to stack, as ``(chunk, shape)`` (16 or more small tensors of one
    shape, at most ``_STACK_ELEMENTS`` elements a chunk), and the rest, reduced one by one (a few of a
    shape: one more call would cost more than it saves; big ones: no copy)."""
    if len(tensors) < _STACK_MIN:  # too few for any stack
        return [], list(range(len(tensors)))
    by_shape: dict[torch.Size, list[int]] = {}
    for j, shape in enumerate(map(_SHAPE, tensors)):
        by_shape.setdefault(shape, []).append(j)
    chunks: list[tuple[list[int], torch.Size]] = []
    single: list[int] = []
    for shape, members in by_shape.items():
        if len(members) < _STACK_MIN or shape.numel() > _STACKED_NUMEL:
            single.extend(members)
            continue
        step = max(1, _STACK_ELEMENTS // max(1, shape.numel()))
        chunks += [(members[lo : lo + step], shape) for lo in range(0, len(members), step)]
    return chunks, single


_SHAPE = operator.attrgetter("shape")


def _recheck_overflow(
    grads: Sequence[torch.Tensor | None], overflow: list[int], statuses: list[str], norms: list[float | None]
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


def judged(values: list[float], present: list[bool] | None) -> tuple[list[str], list[float | None]]:
    """Statuses and norms from L1 norms (``values``, taken as the norms: not copied). ``present``:
    which parameters have a gradient (None: all); an absent one's value is a placeholder 0.0, and its
    status none, its norm None."""
    judge = status_of  # looked up per call: the one place statuses are decided (tests replace it)
    shipped = judge is _SHIPPED_STATUS_OF
    norms: list[float | None] = values  # type: ignore[assignment]
    if present is None:
        if shipped and _ZERO not in values and math.isfinite(sum(values)):
            return [NONZERO] * len(values), norms  # no zero, and a finite sum: no NaN or inf
        return list(map(judge, values)), norms
    absent = list(compress(range(len(present)), map(operator.not_, present)))
    if shipped and values.count(_ZERO) == len(absent) and math.isfinite(sum(values)):
        statuses = [NONZERO] * len(values)  # the only zeros are the absent ones' placeholders
        for i in absent:
            statuses[i] = NONE
            norms[i] = None
        return statuses, norms
    statuses = [judge(v) if p else NONE for v, p in zip(values, present, strict=True)]
    for i in absent:
        norms[i] = None
    return statuses, norms


def status_of(max_abs: float) -> str:
    """The status implied by a gradient's largest absolute value."""
    if math.isnan(max_abs):
        return NAN
    if math.isinf(max_abs):
        return INF
    return ZERO if max_abs == 0.0 else NONZERO


# The fast path in ``read`` decides as this function would, so it is taken only while this is the
# function in use (a test that swaps in another judge gets it called for every value).
_SHIPPED_STATUS_OF = status_of


# ----- a probe's reductions planned once -----------------------------------------------------------


def _getter(idx: Sequence[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """``lambda xs: tuple(xs[i] for i in idx)`` at C speed."""
    if len(idx) == 1:
        (i,) = idx
        return lambda xs: (xs[i],)
    return operator.itemgetter(*idx)


class Plan:
    """How every gradient list of one probe is reduced, decided once from the parameters.

    Autograd hands back each input's gradient in the input's own shape, dtype and device, so the
    grouping ``read`` finds again for every list (by device, dtype, layout, then by shape) is the
    same for every term of a probe: found once here, a reduction is a few stacks and one norm call
    per group (``stacks``: 16 or more small gradients of one shape), and one ``_foreach_norm`` over
    the rest (``singles``). Only for parameters of one device and one real floating dtype
    (``plan_for`` returns None otherwise); a gradient list holding a sparse gradient is left to
    ``read`` (``take`` returns None).

    ``take`` keeps each term's stacked copies of its small gradients: a scenario of several terms
    sums them (one add per group instead of one per parameter). ``read_planned`` reduces any number
    of taken lists with one norm call per group and one ``_foreach_norm`` for all of their singles,
    and copies everything to the host at once.
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.size = len(params)
        self.like = params[0]
        self.acc = _accumulation_dtype(self.like.dtype)
        chunks, singles = _shape_groups(params)
        # (indices, their getter, shape) per stacked chunk; the rest are reduced one by one.
        self.stacks = [(chunk, _getter(chunk), shape) for chunk, shape in chunks]
        order = [i for chunk, _ in chunks for i in chunk]
        self.stacked = len(order)  # norms of stacked gradients come first, then the singles'
        self.singles = singles
        self.single_getter = _getter(singles) if singles else None
        order.extend(singles)
        # Position of each parameter's norm among [stacked..., singles...], applied on the host.
        self.at = _getter(sorted(range(len(order)), key=order.__getitem__))
        self._zeros: dict[torch.Size, torch.Tensor] = {}

    def zeros(self, shape: torch.Size) -> torch.Tensor:
        """A zero tensor standing in for a missing gradient in a stack (shared: never written)."""
        z = self._zeros.get(shape)
        if z is None:
            z = self._zeros[shape] = torch.zeros(shape, dtype=self.like.dtype, device=self.like.device)
        return z

    def take(self, grads: Sequence[torch.Tensor | None]) -> Launched | None:
        """``grads`` ready to reduce: which are present, the stacked small ones, the others; None when
        a gradient is not dense (``read`` handles those)."""
        present = list(map(operator.is_not, grads, repeat(None)))
        complete = all(present)
        if not set(map(_LAYOUT, grads if complete else compress(grads, present))) <= _STRIDED:
            return None
        stacks: list[torch.Tensor | None] = []
        for _, get, shape in self.stacks:
            members = get(grads)
            if not complete and not all(get(present)):
                if not any(get(present)):
                    stacks.append(None)
                    continue
                z = self.zeros(shape)
                members = [z if g is None else g for g in members]
            stacks.append(torch.stack(members))
        singles = list(self.single_getter(grads)) if self.single_getter is not None else []
        return Launched(grads, present, complete, stacks, singles)

    def norm_parts(self, launched: Sequence[Launched]) -> list[torch.Tensor]:
        """The L1 norms (accumulation dtype, on the device) of each group of each of ``launched`` in
        order, then those of all their present singles in one ``_foreach_norm``."""
        parts: list[torch.Tensor] = []
        for x in launched:
            for (idx, _, shape), stacked in zip(self.stacks, x.stacks, strict=True):
                if stacked is None:  # no gradient in this group: its statuses are none
                    parts.append(self.zeros(torch.Size((len(idx),))).to(self.acc))
                else:
                    parts.append(
                        torch.linalg.vector_norm(
                            stacked.reshape(len(idx), shape.numel()), 1, dim=1, dtype=self.acc
                        )
                    )
        singles = [g for x in launched for g in x.singles if g is not None]
        if singles:
            parts.append(torch.stack(torch._foreach_norm(singles, 1, dtype=self.acc)))
        return parts


_STRIDED = {torch.strided}


class Launched:
    """One gradient list taken by ``Plan.take``: which gradients are present, the stacked groups,
    the singles (``plan.singles``' gradients; None: none, or one whose status another measurement
    gives), and the gradients themselves (kept until read, for the rare overflow recheck;
    ``gradients`` builds them only then where they are a sum's stacks)."""

    __slots__ = ("_grads", "_make", "complete", "present", "singles", "stacks")

    def __init__(
        self,
        grads: Sequence[torch.Tensor | None] | Callable[[], Sequence[torch.Tensor | None]],
        present: list[bool],
        complete: bool,
        stacks: list[torch.Tensor | None],
        singles: list[torch.Tensor | None],
    ) -> None:
        self._grads = None if callable(grads) else grads
        self._make = grads if callable(grads) else None
        self.present = present
        self.complete = complete
        self.stacks = stacks
        self.singles = singles

    def gradients(self) -> Sequence[torch.Tensor | None]:
        if self._grads is None:
            assert self._make is not None
            self._grads = self._make()
        return self._grads


def read_planned(
    plan: Plan, launched: Sequence[Launched], extra: torch.Tensor | None = None
) -> tuple[list[tuple[list[str], list[float | None]]], list[float] | None]:
    """Statuses and norms, in parameter order, of each taken gradient list, and ``extra`` (a 1-D float
    tensor on the same device, e.g. the term values) as floats: one device-to-host copy for all."""
    parts = plan.norm_parts(launched)
    if extra is not None:
        parts.append(extra)
    if not parts:
        host: list[float] = []
    elif len(parts) == 1:
        host = parts[0].tolist()
    elif len(dtypes := set(map(_DTYPE, parts))) == 1:
        host = torch.cat(parts).tolist()
    else:  # the widest dtype among them (a device holding float64 tensors supports float64)
        wide = max(dtypes, key=_bits)
        host = torch.cat([t.to(wide) for t in parts]).tolist()
    # Stacked norms come item by item; the singles' for all items after them (``norm_parts``).
    n_stacked = plan.stacked
    singles_at = n_stacked * len(launched)
    out = []
    for k, x in enumerate(launched):
        values = host[k * n_stacked : (k + 1) * n_stacked]
        if x.singles:
            if all(map(operator.is_not, x.singles, repeat(None))):
                values += host[singles_at : singles_at + len(x.singles)]
                singles_at += len(x.singles)
            else:  # missing (or known) singles took no place among the norms: zero, status from present
                for g in x.singles:
                    if g is None:
                        values.append(_ZERO)
                    else:
                        values.append(host[singles_at])
                        singles_at += 1
        statuses, norms = judged(list(plan.at(values)), None if x.complete else x.present)
        if _INF in norms:  # an inf, or a finite sum past the accumulation dtype: rechecked
            _recheck_overflow(x.gradients(), [i for i, v in enumerate(norms) if v == _INF], statuses, norms)
        out.append((statuses, norms))
    extra_host = host[singles_at:] if extra is not None else None
    return out, extra_host


def plan_for(params: Sequence[torch.Tensor]) -> Plan | None:
    """A ``Plan`` for ``params``: parameters of one device and one real floating dtype, all dense;
    else None (each read then groups its gradients itself)."""
    if not params:
        return None
    dtypes = set(map(_DTYPE, params))
    if (
        len(dtypes) != 1
        or not next(iter(dtypes)).is_floating_point
        or len(set(map(_DEVICE, params))) != 1
        or set(map(_LAYOUT, params)) != _STRIDED
    ):
        return None
    return Plan(params)
