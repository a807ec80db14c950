"""Leave the user's objects exactly as found, even on error and on ``KeyboardInterrupt`` (which is
re-raised, never recorded). One mechanism for all of it:

* the model (``_snapshot_model``): parameters, their ``.grad`` objects and values, ``requires_grad``,
  buffers, every module's attributes as bindings (a shallow copy of each ``__dict__``: a counter, a
  stored activation, old-style ``weight_norm``'s computed weight, attributes the step added, replaced
  parameters and submodules), the contents of nn.Module's own containers (parameters, buffers,
  submodules, hook dicts), and tensor hooks on parameters;
* process-wide state (``GLOBALS``, each a ``Global(name, read, write)``, added with ``register``):
  grad mode, default dtype and device, deterministic algorithms, anomaly mode, matmul precision,
  ``torch.autograd.grad``, threads, warn-always, flush-denormal, autograd multithreading, cudnn/mkldnn
  and cuBLAS flags (these plain settings read together as one tuple), the function-mode and
  dispatch-mode stacks, global module and optimizer hooks, the dynamo / inductor / functorch /
  compiler configs, the RNG streams. Other modules register their own pieces.
* torch's config values (ContextVars on torch 2.10 and later): a probe runs in a copy of the context
  (``contained``), where what a step sets on any config module is gone when it returns; ``preserved``
  then copies none of them (``contained=True``), only the mutable values set before are copied and put
  back if edited in place.

Not restored: the contents of objects a module attribute refers to (a list the step appends to, a
plain tensor attribute edited in place, a cache object's state), anything outside the model and torch
(the user's globals, files).

Probes in several threads run one at a time (``_PROBE_LOCK``): each reseeds and restores process-wide
state, which two at once would interleave.

Cost: one copy of the parameters, ``.grad`` and buffers (on their own device; one flat copy per
device and dtype for plain tensors; for a few small ones on the CPU, the bytes of their memory, read
without a torch op) for the duration of the probe, compared bit for bit at the end
and written back where it differs (groups of small tensors: one flatten and one comparison per
group, a quarter of a write per tensor) or simply written back (big tensors: fewer bytes moved than
a comparison); both undo what no version counter records. A shallow copy of each module's
``__dict__``; of torch's config values, only the mutable ones set before the probe (a copy of the
context isolates the rest; older torch: every value, read from torch's own cache). Few Python
objects are held per parameter: the garbage collector traverses every one of them in each full
collection the user's step sets off. The write-back goes through aliases with version counters of
their own, so a tensor the step left alone keeps its ``_version``. Tensor subclasses and overlapping or conjugate views
are compared first and written only if changed. (Writing also dirties the pages of a model
memory-mapped from a file, ``torch.load(mmap=True)``: they become private memory, as any write would
make them.)
"""

from __future__ import annotations

import copy
import ctypes
import gc
import importlib
import operator
import platform
import random
import struct
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar, copy_context
from dataclasses import dataclass
from itertools import chain, islice, repeat
from typing import Any

import torch
import torch.optim.optimizer
import torch.utils.deterministic
from torch.utils._config_module import ConfigModule

_PLAIN = (torch.Tensor, torch.nn.Parameter)


class gc_paused:  # noqa: N801 (used as a function: ``with gc_paused():``)
    """The cyclic garbage collector off while gradprobe's own bookkeeping allocates (a snapshot of
    thousands of modules, the flow map's cells): its allocations would otherwise trigger collections
    that traverse the whole heap, the model's parameters included (two thirds of a snapshot's time at
    4,000 modules). Never around the user's code: cycles a step creates are collected as usual. A
    class, not a generator: entered several times per probe, it costs a fraction of a microsecond."""

    __slots__ = ("_paused",)

    def __enter__(self) -> None:
        self._paused = gc.isenabled()
        if self._paused:
            gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self._paused:
            gc.enable()


def _replaced(t: torch.Tensor, alias: torch.Tensor) -> bool:
    """The tensor no longer has its original storage, offset, sizes, strides or dtype (``p.data = ...``,
    ``resize_``, ``set_``, ``as_strided_``, a dtype view)."""
    if alias.is_cpu or alias.is_cuda:  # one call; is_set_to has no kernel on some devices (meta)
        return not t.is_set_to(alias) or t.dtype != alias.dtype
    return (
        t.data_ptr() != alias.data_ptr()
        or t.dtype != alias.dtype
        or t.shape != alias.shape
        or t.stride() != alias.stride()
    )


def _writable(t: torch.Tensor, alias: torch.Tensor) -> bool:
    """A plain dense tensor whose every element has its own memory: its copy can be written back
    through the alias exactly, whatever happened to it (one read and one write, no sync)."""
    return (
        type(t) in _PLAIN
        and type(alias) is torch.Tensor
        and not alias.is_conj()
        and not alias.is_neg()
        and (alias.is_contiguous() or alias.is_contiguous(memory_format=torch.channels_last))
    )


_DATA = operator.attrgetter("data")
_GRAD = operator.attrgetter("grad")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
_LAYOUT = operator.attrgetter("layout")
_PLAIN_TYPES = frozenset(_PLAIN)
_IS_CPU = operator.attrgetter("is_cpu")
_IS_CUDA = operator.attrgetter("is_cuda")


def _all_plain(tensors: list[torch.Tensor], aliases: list[torch.Tensor]) -> bool:
    """``_writable`` of every tensor, on the CPU or CUDA, strided and contiguous: each test one
    C-level pass over all of them (a tensor that fails any goes the per-tensor way)."""
    return (
        set(map(type, tensors)) <= _PLAIN_TYPES
        and set(map(type, aliases)) <= {torch.Tensor}
        and set(map(_LAYOUT, aliases)) <= {torch.strided}
        and all(map(operator.or_, map(_IS_CPU, aliases), map(_IS_CUDA, aliases)))
        and not any(map(torch.Tensor.is_conj, aliases))
        and not any(map(torch.Tensor.is_neg, aliases))
        and all(map(torch.Tensor.is_contiguous, aliases))
    )


def _changed(current: list[torch.Tensor], copies: list[torch.Tensor]) -> list[bool]:
    """Which tensors' values differ from their copies, found with batched reductions and one host
    sync per device (only for tensors whose values are not simply written back: tensor subclasses,
    overlapping or conjugate views)."""
    changed = [False] * len(current)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, k in enumerate(copies):
        if k.numel():
            groups.setdefault((k.device, k.dtype), []).append(i)
    for idx in groups.values():
        cs = [current[i] for i in idx]
        ks = [copies[i] for i in idx]
        if cs[0].is_floating_point() or cs[0].is_complex():
            # NaN != NaN: such a tensor reads as changed and is copied back, which is harmless.
            flags = torch.stack([(c != k).any() for c, k in zip(cs, ks, strict=True)]).cpu().tolist()
        else:
            flags = [not torch.equal(c, k) for c, k in zip(cs, ks, strict=True)]
        for i, flag in zip(idx, flags, strict=True):
            changed[i] = bool(flag)
    return changed


def _copy_into(alias: torch.Tensor, copy: torch.Tensor) -> None:
    """``alias.copy_(copy)``, also for an expanded tensor (stride 0: elements that share memory are
    written once, through index 0 of those dimensions)."""
    shared = [
        d for d, (n, st) in enumerate(zip(alias.shape, alias.stride(), strict=True)) if st == 0 and n > 1
    ]
    if shared:
        index = tuple(slice(0, 1) if d in shared else slice(None) for d in range(alias.dim()))
        alias, copy = alias[index], copy[index]
    alias.copy_(copy)


class _Saved:
    """Tensors saved together (parameters, their ``.grad``, buffers): each object, an alias of its
    storage and geometry (``t.data``: the same memory, sizes, strides and dtype, with a version counter
    of its own) and a copy of its values."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.aliases = list(map(_DATA, tensors))
        self.dtypes = list(map(_DTYPE, self.aliases))
        # The usual case, decided for all tensors at once at C speed: plain dense tensors on the CPU
        # or CUDA (``is_set_to`` has a kernel there), neither conjugate nor negative views, contiguous.
        self.strided: list[bool] = []
        self.writable: list[bool] = []
        self.set_to: list[bool] = []
        self.all_plain = self.contiguous = _all_plain(tensors, self.aliases)
        if not self.all_plain:
            # What restore() asks of each alias, decided now: the aliases are gradprobe's own, their
            # layout, type, conjugation and strides do not change (a few calls per tensor fewer).
            self.strided = [a.layout == torch.strided for a in self.aliases]
            self.writable = [_writable(t, a) for t, a in zip(tensors, self.aliases, strict=True)]
            self.set_to = [a.is_cpu or a.is_cuda for a in self.aliases]
            # Channels-last tensors, say: plain after all, one at a time.
            self.all_plain = all(self.strided) and all(self.writable) and all(self.set_to)
        self.copies: list[torch.Tensor] = []
        self.flat: list[tuple[list[int], torch.Tensor]] = []
        self.host: list[bytes] | None = None  # the bytes of a few tensors in host memory
        if self.all_plain and len(tensors) <= _HOST_TENSORS and all(map(_IS_CPU, self.aliases)):
            nbytes = list(map(_NBYTES, self.aliases))
            if sum(nbytes) <= _HOST_BYTES:
                # Read straight from their memory (contiguous: one span each), one copy each and no
                # torch op: a flatten, and the comparison's flatten and equal, are kernels the step
                # has not run, whose code is cold (a tenth of a millisecond on a small model).
                self.pointers = list(map(torch.Tensor.data_ptr, self.aliases))
                self.nbytes = nbytes
                self.shapes = list(map(_SHAPE, self.aliases))
                self.strides = list(map(torch.Tensor.stride, self.aliases))
                self.host = list(map(ctypes.string_at, self.pointers, nbytes))
                return
        if self.all_plain:
            # The values of each (device, dtype) group in one flat copy. One object instead of one
            # per tensor: thousands of copies held through the probe would otherwise each be
            # traversed by every full garbage collection the user's step triggers.
            devices = set(map(_DEVICE, self.aliases))
            if len(devices) <= 1 and len(set(self.dtypes)) <= 1:
                groups = [list(range(len(self.aliases)))] if self.aliases else []
            else:
                by: dict[tuple[torch.device, torch.dtype], list[int]] = {}
                for i, a in enumerate(self.aliases):
                    by.setdefault((a.device, a.dtype), []).append(i)
                groups = list(by.values())
            for idx in groups:
                group = [self.aliases[i] for i in idx]
                # A group of one is cloned: flatten_dense_tensors returns a view, not a copy, of it.
                flat = group[0].clone() if len(group) == 1 else torch._utils._flatten_dense_tensors(group)
                self.flat.append((idx, flat))
        else:
            self.copies = [
                a.clone() if type(t) in _PLAIN else t.detach().clone()
                for t, a in zip(tensors, self.aliases, strict=True)
            ]

    def restore(self) -> None:
        """Each tensor back on its own storage, offset, sizes, strides and dtype, with its saved values.

        Values are compared with their copy, not trusted to version counters: a change no version
        counter sees (``p.data.mul_(2)``, an in-kernel update of BatchNorm's running statistics, a
        write through NumPy) is undone like any other. Groups of many small tensors are compared bit
        for bit first and written only where a group differs (``_unchanged_bits``); big tensors (and a
        group of one) are written back whether or not they changed (one write moves fewer bytes than a
        comparison). The writes go
        through the aliases, whose version counters are their own: a tensor the step left alone keeps
        its ``_version``, so autograd graphs that saved it before the probe stay usable.
        """
        if self.host is not None:
            self._restore_host()
            return
        if self.all_plain:  # storage and dtype checked at C speed, one batched write per group
            if not (
                all(map(torch.Tensor.is_set_to, self.tensors, self.aliases))
                and list(map(_DTYPE, self.tensors)) == self.dtypes
            ):
                for t, alias in zip(self.tensors, self.aliases, strict=True):
                    if not t.is_set_to(alias) or t.dtype != alias.dtype:
                        t.data = alias
            for idx, flat in self.flat:
                targets = [self.aliases[i] for i in idx]
                if len(targets) == 1:
                    torch._foreach_copy_(targets, [flat])
                elif self.contiguous and _unchanged_bits(targets, flat):
                    continue
                elif self.contiguous:  # flat views of both sides: no view shaped like each target
                    flat_targets = list(map(torch.Tensor.view, targets, repeat(-1)))
                    torch._foreach_copy_(
                        flat_targets, torch.split(flat, list(map(torch.Tensor.numel, targets)))
                    )
                else:
                    torch._foreach_copy_(targets, torch._utils._unflatten_dense_tensors(flat, targets))
            return
        write: list[int] = []
        compare: list[int] = []
        for i, (t, alias) in enumerate(zip(self.tensors, self.aliases, strict=True)):
            if not self.strided[i]:  # sparse and other layouts: no storage to write into
                t.data = self.copies[i]
                continue
            if _replaced(t, alias):
                t.data = alias
            (write if self.writable[i] else compare).append(i)
        if write:
            torch._foreach_copy_([self.aliases[i] for i in write], [self.copies[i] for i in write])
        if compare:
            current = [self.aliases[i] for i in compare]
            for i, changed in zip(compare, _changed(current, [self.copies[i] for i in compare]), strict=True):
                if changed:
                    _copy_into(self.aliases[i], self.copies[i])

    def _restore_host(self) -> None:
        """``restore`` for tensors saved as bytes: geometry and storage read at C speed without a torch
        op (pointer, dtype, sizes, strides as saved), values compared as bytes and written back
        byte for byte where they differ (below ``_COMPARE_MIN`` tensors: written back)."""
        tensors, aliases, host = self.tensors, self.aliases, self.host
        assert host is not None
        if list(map(torch.Tensor.data_ptr, aliases)) != self.pointers:
            # A storage the step resized or freed: its memory moved; written back through torch.
            for alias, saved in zip(aliases, host, strict=True):
                if saved:
                    _copy_into(alias, torch.frombuffer(bytearray(saved), dtype=alias.dtype).view(alias.shape))
        if (
            list(map(torch.Tensor.data_ptr, tensors)) != self.pointers
            or list(map(_DTYPE, tensors)) != self.dtypes
            or list(map(_SHAPE, tensors)) != self.shapes
            or list(map(torch.Tensor.stride, tensors)) != self.strides
        ):
            for t, alias in zip(tensors, aliases, strict=True):
                if _replaced(t, alias):
                    t.data = alias  # back on its own storage (``p.data = ...``, ``resize_``, ``set_``)
        pointers = list(map(torch.Tensor.data_ptr, aliases))
        if len(host) < _COMPARE_MIN:
            for pointer, saved in zip(pointers, host, strict=True):
                if saved:
                    ctypes.memmove(pointer, saved, len(saved))
            return
        now = list(map(ctypes.string_at, pointers, self.nbytes))
        if now != host:  # compared in C, bytes by bytes
            for pointer, saved, current in zip(pointers, host, now, strict=True):
                if current != saved:
                    ctypes.memmove(pointer, saved, len(saved))


# Up to this many tensors of at most this many bytes in all, on the CPU, are saved as bytes (``_Saved``):
# a few small ones, where a torch op's fixed cost outweighs the copies.
_HOST_TENSORS = 64
_HOST_BYTES = 1 << 24
_NBYTES = operator.attrgetter("nbytes")
_SHAPE = operator.attrgetter("shape")

# Groups of tensors averaging at most this many elements are compared before they are written:
# one flatten and one bitwise comparison (about 0.6 us a tensor on the CPU) cost a quarter of a
# write through a view per tensor (2.5 us), and the usual outcome, nothing changed, writes nothing.
# Bigger tensors are written without a comparison: then the bytes moved decide, and a comparison reads
# twice what a write moves.
_COMPARE_NUMEL = 4096
# Fewer tensors than this are written without a comparison (a test lowers and raises it). Even for a
# few, the comparison costs less: cold, as a probe's restore runs, 10 small tensors take 126 us to
# flatten and compare against 194 us to write through views (flat views, split, _foreach_copy_).
_COMPARE_MIN = 2
_COMPARE_CHUNK = 1 << 22  # elements flattened at a time: bounds the comparison's temporary memory


# Integers of each element size: two tensors compared as these are compared bit for bit (NaN equal to
# the same NaN, -0.0 unlike 0.0), a word at a time rather than a byte at a time (five times fewer
# instructions for float32 than a byte view).
_BITS_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _unchanged_bits(targets: list[torch.Tensor], flat: torch.Tensor) -> bool:
    """Whether contiguous ``targets`` hold bit for bit the values of their flat copy (NaN equal to
    the same NaN, -0.0 unlike 0.0). Many small tensors only (``_COMPARE_MIN``, ``_COMPARE_NUMEL``),
    flattened at most ``_COMPARE_CHUNK`` elements at a time; one host sync per chunk on a GPU, at the
    end of the probe."""
    if len(targets) < _COMPARE_MIN or flat.numel() > _COMPARE_NUMEL * len(targets):
        return False
    try:
        if flat.numel() <= _COMPARE_CHUNK:
            now = torch._utils._flatten_dense_tensors(targets)
            bits = _BITS_OF.get(flat.element_size(), torch.uint8)
            return torch.equal(now.view(bits), flat.view(bits))
        bits = _BITS_OF.get(flat.element_size(), torch.uint8)
        numels = list(map(torch.Tensor.numel, targets))
        start = offset = size = 0
        for i, n in enumerate(numels):
            size += n
            if i + 1 < len(numels) and size + numels[i + 1] <= _COMPARE_CHUNK:
                continue  # the next tensor fits in this chunk
            now = torch._utils._flatten_dense_tensors(targets[start : i + 1])
            if not torch.equal(now.view(bits), flat.narrow(0, offset, size).view(bits)):
                return False
            start, offset, size = i + 1, offset + size, 0
        return True
    except RuntimeError:  # a dtype with no byte view: written back
        return False


_MISSING = object()


def _same_items(a: Any, b: Any) -> bool:
    """Two snapshots of a container hold the same keys in the same order and the very same objects
    (no tensor ``==``), tested at C speed."""
    if isinstance(a, dict):
        return (
            len(a) == len(b)
            and all(map(operator.is_, a, b))
            and all(map(operator.is_, a.values(), b.values()))
        )
    return a == b  # sets of names


def _contents(container: Any) -> Any:
    # One object per container (a dict or frozenset copy), not a tuple of item pairs: thousands of
    # modules' snapshots stay few objects for the garbage collector to traverse.
    return dict(container) if isinstance(container, dict) else frozenset(container)


def _put_back(container: Any, contents: Any) -> None:
    if not _same_items(container, contents):
        container.clear()
        container.update(contents)


# Per tuple of attribute names (modules of one class share it): those named like nn.Module's
# containers, and a getter of their values. Thousands of modules then cost one lookup and one C-level
# call each, not a test per attribute.
_MACHINERY: dict[tuple[str, ...], tuple[tuple[str, ...], Callable[[dict[str, Any]], tuple[Any, ...]]]] = {}
_CONTAINER_NAMES = frozenset(("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"))
_CONTAINERS = (dict, set)  # a tuple: `dict | set` builds a union object per call
# The exact types nn.Module fills its containers with (hook dicts are OrderedDicts).
_CONTAINER_TYPES = frozenset((dict, set, OrderedDict))


def _machinery(d: dict[str, Any]) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    """The attributes holding containers nn.Module keeps its parts in (filled in place by
    ``register_*`` and ``setattr``): parameters, buffers, submodules, the non-persistent buffer
    names, and every hook dict; and those containers."""
    names = tuple(d)
    cached = _MACHINERY.get(names)
    if cached is None:
        named = tuple(k for k in names if k in _CONTAINER_NAMES or "hooks" in k)
        getter = (
            operator.itemgetter(*named) if len(named) > 1 else (lambda x, k=named: tuple(x[n] for n in k))
        )
        cached = (named, getter)
        if len(_MACHINERY) < 4096:  # a bound: modules with attributes of their own make new tuples
            _MACHINERY[names] = cached
    named, getter = cached
    values = getter(d)
    if set(map(type, values)) <= _CONTAINER_TYPES:  # the usual case: all of them dicts and sets
        return named, values
    keep = [i for i, v in enumerate(values) if isinstance(v, _CONTAINERS)]
    return tuple(named[i] for i in keep), tuple(values[i] for i in keep)


class _Attributes:
    """Every module's attributes as bindings (a shallow copy of ``__dict__``: which object each name
    holds, not the objects' contents), and the contents of nn.Module's own containers. Restoring puts
    back a counter the step bumped, a stored activation, old-style ``weight_norm``'s computed weight,
    a replaced parameter or submodule, and removes attributes, buffers and hooks the step added.
    Tensor hooks on parameters (``register_hook``, ``register_post_accumulate_grad_hook``) likewise.

    The contents are stored flat (every container's length, keys and values in three lists): the
    usual outcome, nothing changed, is established at C speed by comparing them by identity; only
    when something differs are the modules restored one by one."""

    def __init__(self, modules: list[torch.nn.Module], params: list[torch.nn.Parameter]) -> None:
        # Flat lists, not objects per module or container: few objects held through the probe (see
        # _Saved), built and compared by C-level iteration.
        self.modules = modules
        self.saved = [dict(vars(m)) for m in modules]
        machinery = list(map(_machinery, self.saved))
        self.machinery = [named for named, _ in machinery]
        self.containers = list(chain.from_iterable(values for _, values in machinery))
        self.lengths = list(map(len, self.containers))
        # Most containers are empty hook dicts, which their lengths cover; only the filled ones'
        # contents are listed (dict keys and set members, then the dicts' values).
        self.filled = list(filter(None, self.containers))
        self.filled_dicts = [c for c in self.filled if isinstance(c, dict)]
        self.keys = list(chain.from_iterable(self.filled))
        self.values = list(chain.from_iterable(map(dict.values, self.filled_dicts)))
        self.binding_lengths = list(map(len, self.saved))
        self.binding_keys = list(chain.from_iterable(self.saved))
        self.binding_values = list(chain.from_iterable(map(dict.values, self.saved)))
        self.params = params
        # Hook dicts of parameters that have one (most have none: nothing stored for them).
        self.hooks_now = [list(map(operator.attrgetter(name), params)) for name in _TENSOR_HOOKS]
        self.tensor_hooks = {
            (i, name): (hooks, _contents(hooks))
            for name, found in zip(_TENSOR_HOOKS, self.hooks_now, strict=True)
            if found.count(None) != len(found)  # most parameters have none: nothing to list
            for i, hooks in enumerate(found)
            if hooks is not None
        }

    def _unchanged(self) -> bool:
        """Every binding, container and parameter hook dict as saved (identity only, C speed)."""
        is_ = operator.is_
        current = list(map(vars, self.modules))
        if (
            list(map(len, current)) != self.binding_lengths
            or not all(map(is_, chain.from_iterable(current), self.binding_keys))
            or not all(map(is_, chain.from_iterable(map(dict.values, current)), self.binding_values))
            or list(map(len, self.containers)) != self.lengths
            or not all(map(is_, chain.from_iterable(self.filled), self.keys))
            or not all(map(is_, chain.from_iterable(map(dict.values, self.filled_dicts)), self.values))
        ):
            return False
        for name, saved in zip(_TENSOR_HOOKS, self.hooks_now, strict=True):
            if not all(map(is_, map(operator.attrgetter(name), self.params), saved)):
                return False
        return all(_same_items(hooks, contents) for hooks, contents in self.tensor_hooks.values())

    def _saved_contents(self) -> Iterator[Any]:
        """Each container's contents as saved (a dict, or a frozenset of a set's members), in order."""
        keys, values = iter(self.keys), iter(self.values)
        for container, n in zip(self.containers, self.lengths, strict=True):
            members = list(islice(keys, n))  # an empty container holds nothing in the flat lists
            if isinstance(container, dict):
                yield dict(zip(members, islice(values, n), strict=True))
            else:
                yield frozenset(members)

    def restore(self) -> None:
        if self._unchanged():
            return
        contents = self._saved_contents()
        for m, saved, machinery in zip(self.modules, self.saved, self.machinery, strict=True):
            current = vars(m)
            # The same names in the same order bound to the very same objects (never ==: a tensor
            # attribute would compare element-wise), else the bindings are put back.
            same = (
                len(current) == len(saved)
                and all(map(operator.is_, current, saved))
                and all(map(operator.is_, current.values(), saved.values()))
            )
            if not same:
                if current.keys() != saved.keys():  # compared in C
                    for key in [k for k in current if k not in saved]:
                        del current[key]
                for key, value in saved.items():
                    if current.get(key, _MISSING) is not value:
                        current[key] = value
            for key in machinery:
                _put_back(saved[key], next(contents))
        for i, p in enumerate(self.params):
            for name in _TENSOR_HOOKS:
                now = getattr(p, name, None)
                if now is None:
                    continue
                saved_hooks = self.tensor_hooks.get((i, name))
                if saved_hooks is None:
                    now.clear()  # hooks the step added, on a dict autograd already holds: emptied
                elif now is saved_hooks[0]:
                    _put_back(now, saved_hooks[1])


_TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


@dataclass
class _ModelState:
    params: list[torch.nn.Parameter]
    requires_grad: list[bool]
    grads: list[torch.Tensor | None]
    attributes: _Attributes
    saved: _Saved


def _snapshot_model(
    model: torch.nn.Module,
    params: list[torch.nn.Parameter] | None = None,
    modules: list[torch.nn.Module] | None = None,
) -> _ModelState:
    with gc_paused():
        return _take_model_snapshot(
            model,
            list(model.parameters()) if params is None else params,
            list(model.modules()) if modules is None else modules,
        )


def _take_model_snapshot(
    model: torch.nn.Module, params: list[torch.nn.Parameter], modules: list[torch.nn.Module]
) -> _ModelState:
    grads = list(map(_GRAD, params))
    buffers = [b for m in modules for b in m._buffers.values() if b is not None]
    tensors: list[torch.Tensor] = [*params, *(g for g in grads if g is not None), *buffers]
    saved = _Saved(tensors)  # works on the tensors' ``.data`` aliases: nothing for autograd to record
    return _ModelState(params, list(map(_REQUIRES_GRAD, params)), grads, _Attributes(modules, params), saved)


def _restore_model(state: _ModelState) -> None:
    # Attributes first (the modules' parameters, buffers and modes are attributes too), then values.
    with gc_paused():
        _write_model_back(state)


def _write_model_back(state: _ModelState) -> None:
    state.attributes.restore()
    state.saved.restore()  # through the ``.data`` aliases: nothing for autograd to record
    if list(map(_REQUIRES_GRAD, state.params)) == state.requires_grad and all(
        map(operator.is_, map(_GRAD, state.params), state.grads)
    ):
        return  # the usual case, tested at C speed: flags and .grad objects as they were
    for p, requires_grad, grad in zip(state.params, state.requires_grad, state.grads, strict=True):
        if p.requires_grad != requires_grad:
            p.requires_grad_(requires_grad)
        # The very .grad object the user had (optimizers and hooks may hold it), values as they were.
        if p.grad is not grad:
            p.grad = grad


@dataclass
class _RngState:
    torch_cpu: torch.Tensor
    cuda: list[torch.Tensor] | None
    python: Any
    numpy: Any  # _NumpyState, or get_state()'s tuple


def _snapshot_rng() -> _RngState:
    # Not initialised: CUDA has no generator state yet (is_available alone costs more than this).
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    np_state = None
    np = sys.modules.get("numpy")
    if np is not None:
        np_state = _numpy_state(np)
    return _RngState(torch.get_rng_state(), cuda, _python_rng_state(), np_state)


def _restore_rng(state: _RngState) -> None:
    torch.set_rng_state(state.torch_cpu)
    if state.cuda is not None:
        torch.cuda.set_rng_state_all(state.cuda)
    _restore_python_rng(state.python)
    if state.numpy is not None:
        _restore_numpy_rng(sys.modules["numpy"], state.numpy)


# Python's global RNG (``random.random`` and friends: ``random._inst``, an MT19937 in C and a cached
# Gaussian in ``gauss_next``) read and put back as the bytes of its C state (the position and the 624
# words, one copy) where their offset in the object was found: ``getstate`` builds 625 Python ints
# (10 us, a tenth of a small model's probe overhead). The offset is found once per process on a private
# instance, checked there by writing one instance's bytes into another and comparing ``getstate``;
# anything unexpected and ``getstate``/``setstate`` are used.
_PY_MT_BYTES = 4 + 624 * 4  # int index; uint32_t state[624]
_PY_LAYOUT: list[int | None] = []  # [] not yet checked; [None] use getstate; [offset]


def _python_layout() -> int | None:
    try:
        a, b = random.Random(12345), random.Random(67890)
        a.random()  # a position other than the start
        _, internal, _ = a.getstate()
        *words, index = internal
        target = struct.pack("i", index) + struct.pack(f"{len(words)}I", *words)
        if len(target) != _PY_MT_BYTES:
            return None
        memory = ctypes.string_at(id(a), type(a).__basicsize__)  # the object's own memory, no more
        at = memory.find(target)
        if at <= 0 or memory.find(target, at + 1) != -1:
            return None
        ctypes.memmove(id(b) + at, id(a) + at, _PY_MT_BYTES)
        if b.getstate()[1] != internal or b.random() != a.random():
            return None
        return at
    except Exception:
        return None


def _python_mt() -> tuple[random.Random, int] | None:
    """The global RNG's instance (the one ``random.getstate`` and friends are bound to) and the address
    of its C state, where the layout is known and the instance is a plain ``random.Random``; else None."""
    if not _PY_LAYOUT:
        _PY_LAYOUT.append(_python_layout())
    at = _PY_LAYOUT[0]
    inst = getattr(random.getstate, "__self__", None)
    if at is None or type(inst) is not random.Random:
        return None
    return inst, id(inst) + at


def _python_rng_state() -> Any:
    """Python's global RNG state: ``(bytes, gauss_next)`` where its layout was found, else
    ``random.getstate()``."""
    found = _python_mt()
    if found is None:
        return random.getstate()
    inst, address = found
    return ctypes.string_at(address, _PY_MT_BYTES), inst.gauss_next


def _restore_python_rng(saved: Any) -> None:
    found = _python_mt()
    if found is not None and type(saved) is tuple and len(saved) == 2 and type(saved[0]) is bytes:
        inst, address = found
        ctypes.memmove(address, saved[0], _PY_MT_BYTES)
        inst.gauss_next = saved[1]
        return
    random.setstate(saved)


# NumPy's legacy RNG (``np.random.seed`` and friends: an MT19937 and a cached Gaussian) read and put
# back without ``get_state``/``set_state`` where that is exact: its 624 words and position through the
# bit generator's public ctypes address (one memmove), its cached Gaussian (``has_gauss``, ``gauss``)
# from the RandomState object's own memory at offsets found once per process on a private instance
# and checked there against ``get_state`` with and without a cached Gaussian (only read there, never
# written; any mismatch and ``get_state`` is used). ``get_state`` costs 40 us warm, 100 us cold (its
# key goes through a Python-level loop); this, a few. The put-back writes the words (after a reseed
# where a Gaussian is cached now), or calls ``set_state`` where one was cached before the probe.
_MT_WORDS = 624
_MT_BYTES = _MT_WORDS * 4 + 4  # the key and the position, as the C struct holds them
_NUMPY_LAYOUT: list[Any] = []  # [] not yet checked; [None] use get_state; [(has_gauss, gauss offsets)]


@dataclass
class _NumpyState:
    words: bytes  # the 624 key words and the position, as mt19937_state holds them
    has_gauss: int
    gauss: float

    def as_tuple(self, np: Any) -> tuple[Any, ...]:
        key = np.frombuffer(self.words[: _MT_WORDS * 4], dtype=np.uint32).copy()
        pos = int.from_bytes(self.words[_MT_WORDS * 4 :], sys.byteorder, signed=True)
        return ("MT19937", key, pos, self.has_gauss, self.gauss)


def _numpy_layout(np: Any) -> tuple[int, int] | None:
    """Offsets of ``has_gauss`` and ``gauss`` in a RandomState, checked on a private instance with
    and without a cached Gaussian; None where they cannot be found (another NumPy build)."""
    try:
        rs_type = np.random.RandomState
        size = rs_type.__basicsize__
        probe = rs_type(12345)
        probe.standard_normal()  # leaves the pair's second value cached
        cached = probe.get_state()
        if cached[3] != 1:
            return None
        memory = ctypes.string_at(id(probe), size)
        target = struct.pack("d", cached[4])
        candidates = [i for i in range(8, size - 7, 8) if memory[i : i + 8] == target]
        if len(candidates) != 1:
            return None
        gauss_at = candidates[0]
        has_at = gauss_at - 8  # int has_gauss, padded to the double's alignment
        if ctypes.c_int.from_address(id(probe) + has_at).value != 1:
            return None
        probe.standard_normal()  # takes the cached value: has_gauss 0, gauss 0.0
        empty = probe.get_state()
        if empty[3] != 0 or ctypes.c_int.from_address(id(probe) + has_at).value != 0:
            return None
        if ctypes.c_double.from_address(id(probe) + gauss_at).value != empty[4]:
            return None
        return has_at, gauss_at
    except Exception:
        return None


_MT_ADDRESS: list[Any] = [None, 0]  # [the bit generator, its state's address]: ``.ctypes`` builds objects


def _mt_address(rand: Any) -> int:
    """The address of the legacy RNG's MT19937 state (ValueError: not an MT19937)."""
    bit_generator = rand._bit_generator
    if _MT_ADDRESS[0] is not bit_generator:
        if type(bit_generator).__name__ != "MT19937":
            raise ValueError("not an MT19937")
        _MT_ADDRESS[:] = [bit_generator, bit_generator.ctypes.state_address]
    return _MT_ADDRESS[1]


def _numpy_state(np: Any) -> Any:
    """The legacy global RNG's state: a ``_NumpyState`` where its layout was found, else
    ``get_state()``."""
    rand = getattr(np.random.mtrand, "_rand", None)
    if not _NUMPY_LAYOUT:
        _NUMPY_LAYOUT.append(_numpy_layout(np))
    layout = _NUMPY_LAYOUT[0]
    if layout is None or type(rand) is not np.random.RandomState:
        return np.random.get_state()
    try:
        address = _mt_address(rand)
    except Exception:
        return np.random.get_state()
    has_at, gauss_at = layout
    return _NumpyState(
        ctypes.string_at(address, _MT_BYTES),
        ctypes.c_int.from_address(id(rand) + has_at).value,
        ctypes.c_double.from_address(id(rand) + gauss_at).value,
    )


def _restore_numpy_rng(np: Any, saved: Any) -> None:
    if isinstance(saved, _NumpyState):
        if saved.has_gauss:  # a cached Gaussian: only set_state puts it back
            np.random.set_state(saved.as_tuple(np))
            return
        try:
            address = _mt_address(np.random.mtrand._rand)
            if _numpy_has_gauss(np) != 0:
                np.random.seed(0)  # clears the cached Gaussian (has_gauss = 0, gauss = 0.0)
            ctypes.memmove(address, saved.words, _MT_BYTES)
        except Exception:
            np.random.set_state(saved.as_tuple(np))
        return
    np.random.set_state(saved)  # get_state()'s tuple


# ----- process-wide state: one mechanism ----------------------------------------------------------


def _equal(a: Any, b: Any) -> bool:
    return a is b or bool(a == b)


@dataclass(frozen=True)
class Global:
    """One piece of process-wide (or thread-wide) state a step or a compile may change: how to read it,
    and how to put a value read before back. ``write`` runs only where ``same(now, saved)`` is False.
    A piece that cannot be read here (a backend not built in) is not saved, and so not restored."""

    name: str
    read: Callable[[], Any]
    write: Callable[[Any], None]
    same: Callable[[Any, Any], bool] = _equal
    # Held in ContextVars (torch's config modules, torch 2.10 and later): a probe run in a copy of the
    # context (``contained``) leaves them alone, and needs no copy of them; see ``contained``.
    contextual: bool = False


GLOBALS: list[Global] = []


def register(
    name: str,
    read: Callable[[], Any],
    write: Callable[[Any], None],
    same: Any = _equal,
    contextual: bool = False,
) -> Global:
    """Save and restore one more piece of process-wide state around every probe (restored in the order
    registered). Other parts of gradprobe add their own here (e.g. dynamo's skip marks) instead of
    saving it themselves."""
    g = Global(name, read, write, same, contextual)
    GLOBALS.append(g)
    return g


def _never_same(a: Any, b: Any) -> bool:
    return False  # the writer compares item by item, or writing is as cheap as comparing


def _deterministic() -> tuple[bool, bool]:
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def _flush_denormal() -> bool:
    # torch has a setter and no getter: a float64 subnormal times one is zero when denormals are flushed.
    if _SSE_FLOATS:
        # The flag is the calling thread's MXCSR, which Python's own float arithmetic obeys too: the
        # same answer without a tensor (a few microseconds cold, and read twice per probe).
        return _TINY * _ONE == 0.0
    with torch._C.DisableTorchFunction():
        tiny = torch.full((1,), 1e-310, dtype=torch.float64, device="cpu")
        return bool((tiny * 1.0).item() == 0.0)


# Module globals, not literals: CPython folds constant expressions at compile time.
_TINY, _ONE = 1e-310, 1.0
_SSE_FLOATS = platform.machine().lower() in ("x86_64", "amd64")


def _default_device_context() -> Any:
    return getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)


def _set_default_device_context(saved: Any) -> None:
    """``torch.set_default_device``'s own steps, back to the saved context object: it keeps its
    ``DeviceContext`` at the bottom of the function-mode stack (restored next, around it)."""
    current = _default_device_context()
    if current is not None:
        current.__exit__(None, None, None)
    if saved is not None:
        saved.__enter__()
    torch._GLOBAL_DEVICE_CONTEXT.device_context = saved


def _same_stack(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _function_modes() -> list[Any]:
    if not torch._C._len_torch_function_stack():  # the usual case: nothing to list
        return []
    from torch.overrides import _get_current_function_mode_stack

    return _get_current_function_mode_stack()


def _set_function_modes(saved: list[Any]) -> None:
    if not saved and not torch._C._len_torch_function_stack():
        return
    from torch.overrides import _pop_mode, _push_mode

    while torch._C._len_torch_function_stack():
        _pop_mode()
    for mode in saved:
        _push_mode(mode)


def _dispatch_modes() -> list[Any]:
    if not torch._C._len_torch_dispatch_stack():  # the usual case: nothing to list
        return []
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return _get_current_dispatch_mode_stack()


def _set_dispatch_modes(saved: list[Any]) -> None:
    if not saved and not torch._C._len_torch_dispatch_stack():
        return
    from torch.utils._python_dispatch import _pop_mode, _push_mode

    while torch._C._len_torch_dispatch_stack():
        _pop_mode()
    for mode in saved:
        _push_mode(mode)


# (names, the objects bound, the positions of the dicts among them, each dict's length, the items of
# the filled ones in order): most registries are empty, so what is compared is mostly lengths.
_Hooks = tuple[tuple[str, ...], tuple[Any, ...], tuple[int, ...], tuple[int, ...], tuple[Any, ...]]


def _hook_dicts(module: Any) -> Callable[[], _Hooks]:
    """Module-level hook registries (dicts of handles, and the odd flag beside them): see ``_Hooks``.
    Their names are listed once (``dir`` of a module costs more than the rest), again when the
    module's namespace changes size; the values are read in C (one attribute getter, maps over the
    dicts)."""
    names: tuple[str, ...] = ()
    at: tuple[int, ...] = ()
    dicts: Callable[[tuple[Any, ...]], tuple[Any, ...]] = tuple
    get: Callable[[Any], tuple[Any, ...]] = lambda _: ()  # noqa: E731
    size = -1

    def read() -> _Hooks:
        nonlocal names, at, dicts, get, size
        if len(vars(module)) != size:
            size = len(vars(module))
            names = tuple(
                n
                for n in dir(module)
                if n.startswith("_global_") and (isinstance(getattr(module, n, None), dict) or "hook" in n)
            )
            at = tuple(i for i, n in enumerate(names) if isinstance(getattr(module, n, None), dict))
            dicts = operator.itemgetter(*at) if len(at) > 1 else (lambda vs, at=at: tuple(vs[i] for i in at))
            get = (
                operator.attrgetter(*names)
                if len(names) > 1
                else (lambda m: tuple(getattr(m, n) for n in names))
            )
        try:
            values = get(module)
            found = dicts(values)
            lengths = tuple(map(len, found))  # TypeError: a registry rebound to another kind of object
            filled = tuple(map(tuple, map(dict.items, filter(None, found)))) if any(lengths) else ()
            return names, values, at, lengths, filled
        except (AttributeError, TypeError):  # a registry deleted or rebound: each looked at on its own
            values = tuple(getattr(module, n, None) for n in names)
            here = tuple(i for i, v in enumerate(values) if isinstance(v, dict))
            found = tuple(values[i] for i in here)
            filled = tuple(tuple(v.items()) for v in found if v)
            return names, values, here, tuple(map(len, found)), filled

    return read


def _set_hook_dicts(module_name: str) -> Callable[[_Hooks], None]:
    def write(saved: _Hooks) -> None:
        module = sys.modules[module_name]
        names, values, at, lengths, filled = saved
        for name, value in zip(names, values, strict=True):
            if getattr(module, name, None) is not value:
                setattr(module, name, value)  # the very object the user's handles refer to
        contents = iter(filled)
        for i, n in zip(at, lengths, strict=True):
            items = next(contents) if n else ()
            if tuple(values[i].items()) != items:
                values[i].clear()
                values[i].update(items)

    return write


def _same_hooks(a: _Hooks, b: _Hooks) -> bool:
    """The same names, the same objects bound, dicts with the same items (in C: handles by identity
    first)."""
    return a[0] == b[0] and all(map(operator.is_, a[1], b[1])) and a[3] == b[3] and a[4] == b[4]


# Config modules restored value by value when already imported before the probe (a compile imports
# them; a step may set e.g. ``torch._dynamo.config.recompile_limit``; gradprobe itself only patches
# ``torch._inductor.config.fallback_random`` inside a context manager).
CONFIG_MODULES = (
    "torch._dynamo.config",
    "torch._inductor.config",
    "torch._functorch.config",
    "torch.compiler.config",
)


def _config_snapshot(
    module: Any, copy_mutable: bool = True, keys: list[str] | None = None
) -> tuple[dict[str, Any], list[str] | None] | None:
    """Every config value of ``module``, mutable ones (lists, sets, dicts) copied (``copy_mutable``;
    a read only to compare with needs no copies).

    ``get_config_copy`` deep-copies every value (about 0.2 ms for inductor's 600 keys, and a probe
    reads each module several times). Where torch offers it, the values are read from its own cache
    (``_get_dict(readonly_values=True)``: a dict copy, updated for the keys set since), exact for the
    immutable values, whose identity changes whenever they are set; the mutable ones are read live
    (an in-place edit, or a first read that materialises a default, does not mark the cache) and
    copied, shallowly where they hold only immutable items.

    Returns the values and the keys whose values were read live (None: every value was copied);
    ``keys``: those keys, known from a snapshot taken before (a restore need not scan for them: a key
    that became mutable since holds another value, which the comparison sees)."""
    try:
        if not _READONLY_CONFIG:
            return module.get_config_copy(), None  # a deep copy of the values that are not immutable
        values = module._get_dict(readonly_values=True)
        if keys is None:
            keys = _mutable_keys(module, values)
        for key in keys:
            if key in values:
                live = _live_value(module, key, values[key])
                values[key] = _copied(live) if copy_mutable else live
        return values, keys
    except Exception:  # a value someone set that cannot be copied: leave this module alone
        return None


# Per config module: its values when last scanned, and the keys holding mutable values then.
_MUTABLE_KEYS: dict[str, tuple[dict[str, Any], list[str]]] = {}


def _mutable_keys(module: Any, values: dict[str, Any]) -> list[str]:
    """The keys of ``values`` that hold mutable values; rescanned only when a value was set since the
    last scan (the dict comparison runs in C, identity first: a few microseconds for 600 keys)."""
    cached = _MUTABLE_KEYS.get(module.__name__)
    if cached is not None and _same_values(cached[0], values):
        return cached[1]
    # type(v) in a set: a third of isinstance's cost; a subclass of an immutable type is merely copied.
    keys = [k for k, v in values.items() if type(v) not in _IMMUTABLE_TYPES]
    _MUTABLE_KEYS[module.__name__] = (dict(values), keys)
    return keys


def _same_values(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """``a == b`` (in C, identity first); False where a value cannot be compared (a tensor in a list)."""
    try:
        return bool(a == b)
    except Exception:
        return False


def _live_value(module: Any, key: str, cached: Any) -> Any:
    """The object ``getattr(module, key)`` returns, without its cost (1.2 us: deprecation and alias
    checks), in the order ``__getattr__`` reads it: an environment override, the value set (or the
    copy of the default a first read materialised), else the untouched default the cache holds.
    Entries of another shape: ``getattr``."""
    try:
        entry = module._config[key]
        if entry.env_value_force is not _UNSET:
            return entry.env_value_force
        value = entry.user_override.get()
    except (AttributeError, KeyError, TypeError):
        return getattr(module, key)
    return cached if value is _UNSET else value


def _readonly_config_supported() -> bool:
    """torch's config modules cache their values (``readonly_values``, torch 2.10 and later)."""
    import inspect

    from torch.utils import _config_module

    try:
        params = inspect.signature(_config_module.ConfigModule._get_dict).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return (
        "readonly_values" in params
        and hasattr(_config_module, "_IMMUTABLE_CONFIG_TYPES")
        and hasattr(_config_module, "_UNSET_SENTINEL")
    )


_READONLY_CONFIG = _readonly_config_supported()
_IMMUTABLE: tuple[type, ...] = (int, float, bool, type(None), str, tuple)
_UNSET: Any = object()
if _READONLY_CONFIG:
    from torch.utils._config_module import _IMMUTABLE_CONFIG_TYPES as _IMMUTABLE
    from torch.utils._config_module import _UNSET_SENTINEL as _UNSET
_IMMUTABLE_TYPES = frozenset(_IMMUTABLE)


def _copied(value: Any) -> Any:
    """A copy of a mutable config value: shallow for a list, set or dict of immutable items (most
    are: module names, op names), deep otherwise."""
    if type(value) in (list, set) and all(type(x) in _IMMUTABLE_TYPES for x in value):
        return value.copy()
    if type(value) is dict and all(
        type(k) in _IMMUTABLE_TYPES and type(v) in _IMMUTABLE_TYPES for k, v in value.items()
    ):
        return value.copy()
    return copy.deepcopy(value)


def _context_config_supported() -> bool:
    """torch's config values are ContextVars (torch 2.10 and later): a copy of the context isolates
    every ``setattr`` on a config module."""
    from contextvars import ContextVar

    from torch.utils import _config_module

    try:  # a throwaway entry: its own ContextVar, registered nowhere
        entry = _config_module._ConfigEntry(_config_module._Config(default=False), "gradprobe_probe")  # type: ignore[attr-defined]
    except Exception:
        return False
    return _READONLY_CONFIG and isinstance(getattr(entry, "user_override", None), ContextVar)


_CONTEXT_CONFIG = _context_config_supported()
ContextVarGet = ContextVar.get
_CONTEXT_IMMUTABLE = _IMMUTABLE_TYPES | {type(_UNSET)}
# Per config module: the entries whose default is mutable (a list, set or dict; a first read copies it
# into the entry's ContextVar, which an in-place edit then changes), their keys and ContextVars; listed
# again when entries are added.
_OVERRIDES: dict[str, tuple[int, list[str], list[Any]]] = {}


def _overrides(module: Any) -> tuple[list[str], list[Any]]:
    """The keys of ``module``'s config entries with a mutable default, and the ContextVars holding
    what was set on them (about 50 of torch's 900 entries)."""
    found = _OVERRIDES.get(module.__name__)
    if found is None or found[0] != len(module._config):
        keys = [
            k
            for k, e in module._config.items()
            if getattr(e, "alias", None) is None and type(e.default) not in _IMMUTABLE_TYPES
        ]
        found = _OVERRIDES[module.__name__] = (
            len(module._config),
            keys,
            [module._config[k].user_override for k in keys],
        )
    return found[1], found[2]


_CONFIG_MODULES_SEEN: list[Any] = [-1, []]  # [len(sys.modules) when listed, the config modules then]


def _config_modules() -> list[Any]:
    """Every imported config module (torch's ``install_config_module``), listed again only when the
    number of imported modules changed."""
    n = len(sys.modules)
    if _CONFIG_MODULES_SEEN[0] != n:
        _CONFIG_MODULES_SEEN[:] = [n, [m for m in list(sys.modules.values()) if isinstance(m, ConfigModule)]]
    return _CONFIG_MODULES_SEEN[1]


_WATCHED: list[Any] = [None, (), ()]  # [the module list watched, (module, key) per var, the vars]


def _mutable_configs(modules: list[Any]) -> list[tuple[Any, str, Any, Any]]:
    """(module, key, value, copy) for every config value of a mutable default set before (a list, set
    or dict): a copy of the context keeps what is set, not what is edited in place. One C-level pass
    over the ContextVars of all modules (listed again when the modules or their entries change);
    usually nothing is found."""
    if _WATCHED[0] is not modules or any(
        found[0] != len(m._config) for m in modules if (found := _OVERRIDES.get(m.__name__))
    ):
        owners: list[tuple[Any, str]] = []
        overrides: list[Any] = []
        for module in modules:
            try:
                keys, found = _overrides(module)
            except Exception:  # entries of another shape: left alone
                continue
            owners += [(module, k) for k in keys]
            overrides += found
        _WATCHED[:] = [modules, owners, overrides]
    owners, overrides = _WATCHED[1], _WATCHED[2]
    values = list(map(ContextVarGet, overrides))
    if values.count(_UNSET) == len(values) or set(map(type, values)) <= _CONTEXT_IMMUTABLE:
        return []
    out = []
    for (module, key), value in zip(owners, values, strict=True):
        if type(value) not in _CONTEXT_IMMUTABLE:
            try:
                out.append((module, key, value, _copied(value)))
            except Exception:  # a value that cannot be copied: left alone
                continue
    return out


def contained(fn: Callable[[], Any]) -> Any:
    """``fn()`` in a copy of the current context: what it sets on torch's config modules (ContextVars)
    is gone when it returns, without reading or comparing a value (the config modules hold about
    900 of them; ``preserved(contained=True)`` then skips them). What is edited in place in a value
    set before (a list ``append``) is put back from a copy. Config modules first imported by ``fn``
    keep what was set in them (as ``preserved`` alone does: only modules imported before are
    restored): their values are carried out of the copy. Without ContextVar configs (older torch),
    just ``fn()``."""
    if not _CONTEXT_CONFIG:
        return fn()
    before = _config_modules()
    edited = _mutable_configs(before)
    context = copy_context()
    try:
        return context.run(fn)
    finally:
        for module, key, value, saved in edited:
            try:
                if value is not saved and not _same_values({key: value}, {key: saved}):
                    setattr(module, key, _copied(saved))
            except Exception:
                continue
        now = _config_modules()
        if now is not before:  # modules were imported: any config module among them?
            known = set(map(id, before))
            _carry_out(context, [m for m in now if id(m) not in known])


def _carry_out(context: Any, modules: list[Any]) -> None:
    """The values set inside ``context`` on config modules imported there, set here too."""
    for module in modules:
        for entry in list(getattr(module, "_config", {}).values()):
            var = getattr(entry, "user_override", None)
            if not isinstance(var, ContextVar):
                continue
            value = context.get(var, _UNSET)
            if value is not _UNSET and var.get() is not value:
                var.set(value)


def _read_config(name: str) -> Callable[[], Any]:
    def read() -> Any:
        module = sys.modules.get(name)
        found = _config_snapshot(module) if hasattr(module, "get_config_copy") else None
        if found is None:
            raise LookupError(name)  # not imported, or not copyable: not saved, not restored
        return module, *found

    return read


def _write_config(saved: tuple[Any, dict[str, Any], list[str] | None]) -> None:
    """Each value that differs from the saved one set back (a fresh copy of a mutable one: the saved
    copy must not become the live, editable value)."""
    module, values, keys = saved
    found = _config_snapshot(module, copy_mutable=False, keys=keys)
    current = None if found is None else found[0]
    if current is not None and _same_values(current, values):  # the usual case, compared in C
        return
    for key, value in values.items():
        try:
            now = current[key] if current is not None else getattr(module, key)
            if now is not value and bool(now != value):
                setattr(module, key, value if isinstance(value, _IMMUTABLE) else _copied(value))
        except Exception:  # a key gone, or values that cannot be compared: leave it
            continue


def _set_deterministic(saved: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])


def _set_autograd_grad(saved: Any) -> None:
    torch.autograd.grad = saved


def _set_fill_uninitialized(saved: bool) -> None:
    torch.utils.deterministic.fill_uninitialized_memory = saved  # type: ignore[attr-defined]


def _set_anomaly(saved: tuple[bool, bool]) -> None:
    torch.autograd.set_detect_anomaly(*saved)


def _getter_of(path: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """Read and write a flag attribute of a ``torch.backends`` module, its owner looked up once (its
    path walk costs more than the flag). Read through the module's own C getter where the attribute is
    a ``ContextProp`` (what reading it calls, without the descriptor and module lookups); written by
    setting the attribute, as a user would (``disable_global_flags`` is respected)."""
    module_name, _, attr = path.rpartition(".")
    found: list[Any] = []

    def owner() -> Any:
        if not found:
            obj: Any = torch
            for part in module_name.split(".")[1:]:
                obj = getattr(obj, part)
            found.append(obj)
        return found[0]

    prop = getattr(type(owner()), "__dict__", {}).get(attr)
    getter = getattr(prop, "getter", None)
    if callable(getter):
        return getter, (lambda v: setattr(owner(), attr, v))
    return (lambda: getattr(owner(), attr)), (lambda v: setattr(owner(), attr, v))


def _cublas_setting(kind: str) -> tuple[str, Callable[[], Any], Callable[[Any], None]]:
    pair = _cublas(kind)
    if pair is not None:
        return (f"cuBLAS {kind} reduced-precision reduction", *pair)
    path = f"torch.backends.cuda.matmul.allow_{kind}_reduced_precision_reduction"
    return (path, *_getter_of(path))


def _cublas(kind: str) -> tuple[Callable[[], Any], Callable[[Any], None]] | None:
    """cuBLAS' reduced-precision reduction setting for ``kind`` (fp16, bf16): both of its flags, read and
    written as torch keeps them (setting the attribute to a bool would reset the split-k flag)."""
    get = getattr(torch._C, f"_get_cublas_allow_{kind}_reduced_precision_reduction", None)
    put = getattr(torch._C, f"_set_cublas_allow_{kind}_reduced_precision_reduction", None)
    if get is None or put is None:
        return None
    return get, (lambda v: put(*v) if isinstance(v, tuple) else put(v))


# Process-wide settings that hold plain values, each a (name, read, write). They are read together as
# one tuple (``_read_settings``: one piece of the registry instead of one per setting, a few
# microseconds instead of tens for the registry's per-piece calls) and written back one by one where
# they differ, every writer tried even if another raises.
_SETTINGS: list[tuple[str, Callable[[], Any], Callable[[Any], None]]] = [
    ("grad mode", torch.is_grad_enabled, torch.set_grad_enabled),
    ("default dtype", torch.get_default_dtype, torch.set_default_dtype),
    ("deterministic algorithms", _deterministic, _set_deterministic),
    (
        "fill uninitialized memory",
        lambda: torch.utils.deterministic.fill_uninitialized_memory,  # type: ignore[attr-defined]
        _set_fill_uninitialized,
    ),
    (
        "anomaly mode",
        lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        _set_anomaly,
    ),
    ("float32 matmul precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    ("torch.autograd.grad", lambda: torch.autograd.grad, _set_autograd_grad),
    ("intra-op threads", torch.get_num_threads, torch.set_num_threads),
    ("warn always", torch.is_warn_always_enabled, torch.set_warn_always),
    ("flush denormal", _flush_denormal, torch.set_flush_denormal),
    ("autograd multithreading", torch._C._is_multithreading_enabled, torch._C._set_multithreading_enabled),
    *(
        (path, *_getter_of(path))
        for path in (
            "torch.backends.cudnn.enabled",
            "torch.backends.cudnn.benchmark",
            "torch.backends.cudnn.deterministic",
            "torch.backends.cudnn.allow_tf32",
            "torch.backends.mkldnn.enabled",
        )
    ),
    *(_cublas_setting(kind) for kind in ("fp16", "bf16")),
]


def _readable(read: Callable[[], Any]) -> bool:
    try:
        read()
    except Exception:
        return False
    return True


# A setting this build cannot read (a backend not built in) is left out, as the registry leaves out a
# piece it cannot read: not saved, so not restored.
_SETTINGS = [x for x in _SETTINGS if _readable(x[1])]
_SETTING_READERS = tuple(read for _, read, _ in _SETTINGS)


def _read_settings() -> tuple[Any, ...]:
    return tuple([read() for read in _SETTING_READERS])


def _write_settings(saved: tuple[Any, ...]) -> None:
    errors = []
    for (_, read, write), value in zip(_SETTINGS, saved, strict=True):
        try:
            now = read()
            # Identity first: a function (torch.autograd.grad) is compared as itself.
            if now is not value and now != value:
                write(value)
        except Exception as e:  # each setting is restored even if another fails
            errors.append(e)
    if errors:
        raise errors[0]


def _same_settings(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return a == b  # the usual case, compared in C (identity first per item)


register("settings", _read_settings, _write_settings, _same_settings)


def _cuda_device() -> int | None:
    # None (nothing to put back) while CUDA is not initialised: no exception raised on every probe.
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None


def _set_cuda_device(saved: int | None) -> None:
    if saved is not None:
        torch.cuda.set_device(saved)


register("current CUDA device", _cuda_device, _set_cuda_device)
# The default device before the function-mode stack: its context lives at the stack's bottom.
register("default device", _default_device_context, _set_default_device_context, lambda a, b: a is b)
register("function-mode stack", _function_modes, _set_function_modes, _same_stack)
register("dispatch-mode stack", _dispatch_modes, _set_dispatch_modes, _same_stack)
register(
    "global module hooks",
    _hook_dicts(sys.modules["torch.nn.modules.module"]),
    _set_hook_dicts("torch.nn.modules.module"),
    _same_hooks,
)
register(
    "global optimizer hooks",
    _hook_dicts(sys.modules["torch.optim.optimizer"]),
    _set_hook_dicts("torch.optim.optimizer"),
    _same_hooks,
)
for _name in CONFIG_MODULES:
    register(_name, _read_config(_name), _write_config, _never_same, contextual=_CONTEXT_CONFIG)
register("RNG streams", lambda: _snapshot_rng(), lambda v: _restore_rng(v), _never_same)


def _snapshot_globals(contained: bool = False) -> list[tuple[Global, Any]]:
    """Each registered piece's value (``contained``: not those a copy of the context isolates)."""
    saved = []
    for g in GLOBALS:
        if contained and g.contextual:
            continue
        try:
            saved.append((g, g.read()))
        except Exception:  # not readable here: not saved, so not restored
            continue
    return saved


def _restore_globals(saved: list[tuple[Global, Any]]) -> list[Exception]:
    errors: list[Exception] = []
    for g, value in saved:
        try:
            # A piece that is never "the same" compares inside its writer: reading it first is wasted.
            if g.same is _never_same or not g.same(g.read(), value):
                g.write(value)
        except Exception as e:  # each piece is restored even if another fails
            errors.append(e)
    return errors


# One probe at a time per process: probes reseed the process-wide RNG and save and restore the
# process-wide state above, so two at once in two threads would draw each other's random numbers and
# undo each other's restores. Reentrant: a step may itself call probe().
_PROBE_LOCK = threading.RLock()


@contextmanager
def preserved(
    model: torch.nn.Module,
    params: list[torch.nn.Parameter] | None = None,
    modules: list[torch.nn.Module] | None = None,
    contained: bool = False,
) -> Iterator[None]:
    """Run the body, then put the model and every registered piece of process-wide state (``GLOBALS``:
    settings, RNG streams, mode stacks, hooks, configs) back as they were. Probes in several threads
    run one at a time. ``params`` and ``modules``: ``list(model.parameters())`` and
    ``list(model.modules())`` when the caller has them already. ``contained``: the caller runs inside
    ``contained()``, which isolates the config modules: they are not copied here."""
    with _PROBE_LOCK:
        model_state = _snapshot_model(model, params, modules)
        saved = _snapshot_globals(contained)
        try:
            yield
        finally:
            # Each part is restored even if another fails. A failure to restore is raised after all ran,
            # unless the body is already raising (its exception, a KeyboardInterrupt say, goes on).
            errors = _restore_globals(saved)
            try:
                _restore_model(model_state)
            except Exception as e:
                errors.append(e)
            if errors and sys.exc_info()[1] is None:
                raise errors[0]


@contextmanager
def isolated_settings(import_configs: bool = False) -> Iterator[None]:
    """The global settings and compiler config as they were before the body, put back after it: what
    one variant's build or run changes (a package's compile preparation flipping dynamo config) does
    not leak into the next variant, the checks or the bisector. ``import_configs`` imports the
    compiler config modules first, so that a path which is about to compile is covered."""
    if import_configs:
        for name in CONFIG_MODULES:
            importlib.import_module(name)
    saved = _snapshot_globals()
    try:
        yield
    finally:
        errors = _restore_globals(saved)
        if errors and sys.exc_info()[1] is None:
            raise errors[0]


def reseed(seed: int) -> None:
    """Seed every RNG a step may draw from, so each run sees the same random stream."""
    _manual_seed(seed)
    _seed_python(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        _seed_numpy(np, seed % 2**32)


_PYTHON_SEEDED: dict[int, bytes] = {}  # seed -> the state bytes random.seed(seed) leaves


def _seed_python(seed: int) -> None:
    """``random.seed(seed)``; where the state's layout is known, by writing the bytes that call left
    the first time and clearing the cached Gaussian, as seeding does (no 624-word initialisation)."""
    found = _python_mt()
    if found is None:
        random.seed(seed)
        return
    inst, address = found
    state = _PYTHON_SEEDED.get(seed)
    if state is None:
        random.seed(seed)
        if len(_PYTHON_SEEDED) < 16:
            _PYTHON_SEEDED[seed] = ctypes.string_at(address, _PY_MT_BYTES)
        return
    ctypes.memmove(address, state, _PY_MT_BYTES)
    inst.gauss_next = None


_NUMPY_SEEDED: dict[int, bytes] = {}  # seed -> the MT19937 words np.random.seed(seed) leaves


def _seed_numpy(np: Any, seed: int) -> None:
    """``np.random.seed(seed)``; where no Gaussian is cached (the usual case) by writing the words that
    call left the first time (the same state: seeding only sets the words and clears the cache)."""
    words = _NUMPY_SEEDED.get(seed)
    try:
        if words is not None and _numpy_has_gauss(np) == 0:
            ctypes.memmove(_mt_address(np.random.mtrand._rand), words, _MT_BYTES)
            return
        np.random.seed(seed)
        if len(_NUMPY_SEEDED) < 16 and _numpy_has_gauss(np) == 0:
            _NUMPY_SEEDED[seed] = ctypes.string_at(_mt_address(np.random.mtrand._rand), _MT_BYTES)
    except Exception:
        np.random.seed(seed)


def _numpy_has_gauss(np: Any) -> int | None:
    """Whether the legacy RNG holds a cached Gaussian (None: its layout is not known here)."""
    layout = _NUMPY_LAYOUT[0] if _NUMPY_LAYOUT else None
    rand = getattr(np.random.mtrand, "_rand", None)
    if layout is None or type(rand) is not np.random.RandomState:
        return None
    return ctypes.c_int.from_address(id(rand) + layout[0]).value


def _compiled_in(name: str) -> bool:
    device = getattr(torch, name, None)
    is_compiled = getattr(device, "_is_compiled", None)
    return device is not None and (is_compiled is None or bool(is_compiled()))


# Devices this build of torch has: one not compiled in is never available (asking costs 20 us cold).
_SEEDED_DEVICES = [getattr(torch, n) for n in ("cuda", "xpu", "mtia") if _compiled_in(n)]


def _manual_seed(seed: int) -> None:
    """``torch.manual_seed`` without its cost where a device is not built in (0.14 ms a call: each of
    cuda, xpu and mtia queues a lazy seed with a formatted stack when it is not initialised). Every
    device that is available is seeded through torch's own call, lazily queued as torch does."""
    for device in _SEEDED_DEVICES:
        if device.is_available() and not device._is_in_bad_fork():
            device.manual_seed_all(seed)
    if torch.backends.mps.is_available() and not torch.mps._is_in_bad_fork():
        torch.mps.manual_seed(seed)
    torch.random._seed_custom_device(seed)  # type: ignore[attr-defined]
    torch.default_generator.manual_seed(seed)
