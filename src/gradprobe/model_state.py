"""What of a model a probe keeps and puts back: parameters, their ``.grad`` objects and values,
``requires_grad``, buffers, every module's class (and a class's own attributes: ``parametrize`` gives a
module a class of its own) and attributes as bindings (a shallow copy of each ``__dict__``: a counter,
a stored activation, old-style ``weight_norm``'s computed weight, replaced parameters and submodules,
attributes the step added), the contents of nn.Module's own containers (parameters, buffers,
submodules, hook dicts) and tensor hooks on parameters.

Values are copied (one flat copy per device and dtype), compared bit for bit at the end (the small
tensors of a group in one comparison, each large one against its part of the copy) and written back
only where they differ, through ``.data`` aliases with version counters of their own: a tensor
the step left alone is never written (its ``_version`` stays, and read-only memory such as a read-only
memory map is never touched). A storage the step freed or resized is put back to its saved size before
anything reads or writes it.

Not kept: the contents of objects a module attribute refers to (a list the step appends to, a plain
tensor attribute edited in place).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

# ----- tensors: values, storage and geometry -------------------------------------------------------

# An integer type of each element size: tensors compared through these views are compared bit for bit
# (a NaN equal to the same NaN, -0.0 unlike 0.0), which value equality is not.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        if a.is_complex():
            a, b = torch.view_as_real(a), torch.view_as_real(b)
        if a.is_floating_point():
            bits = _BITS[a.element_size()]
            a, b = a.view(bits), b.view(bits)
        return torch.equal(a, b)
    except (RuntimeError, KeyError):  # no bit view of this kind of tensor: written back
        return False


def _moved(t: torch.Tensor, alias: torch.Tensor) -> bool:
    """``t`` no longer has its saved storage, offset, sizes, strides or dtype (``p.data = ...``,
    ``resize_``, ``set_``, a dtype view)."""
    if t.dtype != alias.dtype:
        return True
    try:
        return not t.is_set_to(alias)
    except (RuntimeError, NotImplementedError):  # no kernel on this device (meta, some backends)
        try:
            return (t.data_ptr(), t.shape, t.stride()) != (alias.data_ptr(), alias.shape, alias.stride())
        except (RuntimeError, NotImplementedError):  # a subclass without storage: left where it is
            return False


def _copy_into(alias: torch.Tensor, saved: torch.Tensor) -> None:
    """``alias.copy_(saved)``, also for an expanded tensor (stride 0: elements that share memory are
    written once, through index 0 of those dimensions)."""
    shared = [d for d, (n, s) in enumerate(zip(alias.shape, alias.stride(), strict=True)) if s == 0 and n > 1]
    if shared:
        index = tuple(slice(0, 1) if d in shared else slice(None) for d in range(alias.dim()))
        alias, saved = alias[index], saved[index]
    alias.copy_(saved)


def _storage_bytes(alias: torch.Tensor) -> int | None:
    if alias.layout != torch.strided:
        return None
    try:
        return alias.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):  # a subclass without a storage of its own
        return None


# Tensors of this many elements or more are compared alone against their part of the saved flat copy:
# concatenating their values again would copy them (into fresh memory) only to compare them. On the
# benchmark's wide model (three 4096 x 4096 layers, 204 MB of float32) the compare at restore took
# 229 ms with a second concatenated copy and 58 ms this way (2 cores, loaded; benchmarks.md).
_ALONE = 1 << 16


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _plain(t: torch.Tensor, alias: torch.Tensor) -> bool:
    """A dense tensor of torch's own types: copied and compared in its group's flat copy."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and alias.layout == torch.strided
        and not (alias.is_conj() or alias.is_neg() or alias.is_quantized)
    )


class _SavedTensors:
    """Parameters, their ``.grad`` and buffers: each tensor, an alias of its storage and geometry
    (``t.data``: the same memory, sizes, strides and dtype, with a version counter of its own), the
    size of its storage, and a copy of its values (plain tensors: one flat copy per device and dtype)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.aliases = [t.data for t in tensors]
        self.storage_bytes = [_storage_bytes(a) for a in self.aliases]
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        self.others: list[tuple[int, torch.Tensor]] = []  # subclasses, sparse, conjugate views...
        for i, (t, a) in enumerate(zip(tensors, self.aliases, strict=True)):
            if _plain(t, a):
                groups.setdefault((a.device, a.dtype), []).append(i)
            else:
                self.others.append((i, t.detach().clone()))
        # Per group: its members, the small ones first (how many), and one flat copy of their values.
        self.groups: list[tuple[list[int], int, torch.Tensor]] = []
        for idx in groups.values():
            small = [i for i in idx if self.aliases[i].numel() < _ALONE]
            idx = small + [i for i in idx if self.aliases[i].numel() >= _ALONE]
            self.groups.append((idx, len(small), _flat([self.aliases[i] for i in idx])))

    def restore(self) -> None:
        """Storages to their saved size, tensors back on them, then values compared bit for bit and
        written back where they differ (a change no version counter sees, ``p.data.mul_(2)``, a write
        through NumPy, BatchNorm's in-kernel statistics, is undone like any other)."""
        others = dict(self.others)
        for i, (t, a, nbytes) in enumerate(zip(self.tensors, self.aliases, self.storage_bytes, strict=True)):
            if a.layout != torch.strided:  # sparse and other layouts: no storage to write into
                t.data = others.pop(i)
                continue
            if nbytes is not None and a.untyped_storage().nbytes() != nbytes:
                # Freed (FSDP-style ``resize_(0)``), shrunk or grown by the step: back to its saved size
                # before anything reads or writes it.
                a.untyped_storage().resize_(nbytes)
            if _moved(t, a):
                t.data = a
        for idx, n_small, flat in self.groups:
            aliases = [self.aliases[i] for i in idx]
            sizes = [a.numel() for a in aliases]
            ends = list(accumulate(sizes))
            # The small members: one comparison for all (the usual case: nothing differs); where some
            # differ, each compared alone. The large ones alone, against their part of the saved copy.
            differ = n_small and not _same_bits(_flat(aliases[:n_small]), flat[: ends[n_small - 1]])
            for k in range(0 if differ else n_small, len(aliases)):
                a, saved = aliases[k], flat[ends[k] - sizes[k] : ends[k]]
                if not _same_bits(a.reshape(-1), saved):
                    _copy_into(a, saved.view(a.shape))
        for i, saved in others.items():
            a = self.aliases[i]
            if not _same_bits(a, saved):
                _copy_into(a, saved)


# ----- modules: classes, attributes, containers, hooks ---------------------------------------------

_CONTAINER_NAMES = frozenset(("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"))
_TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def _same_contents(container: Any, saved: Any) -> bool:
    """The same keys in the same order bound to the very same objects (never ``==`` on values: a
    tensor would compare element-wise); sets by their members."""
    if isinstance(container, dict):
        return (
            len(container) == len(saved)
            and all(map(operator.is_, container, saved))
            and all(map(operator.is_, container.values(), saved.values()))
        )
    return container == saved


def _put_back(container: Any, saved: Any) -> None:
    if not _same_contents(container, saved):
        container.clear()
        container.update(saved)


# The names of nn.Module's containers among a module's attribute names, by the tuple of those names:
# modules of one class share it, so thousands of modules are scanned once.
_CONTAINERS_OF: dict[tuple[str, ...], tuple[str, ...]] = {}


def _container_names(bindings: dict[str, Any]) -> tuple[str, ...]:
    names = tuple(bindings)
    found = _CONTAINERS_OF.get(names)
    if found is None:
        found = tuple(k for k in names if k in _CONTAINER_NAMES or "hooks" in k)
        if len(_CONTAINERS_OF) < 4096:  # modules with attributes of their own make new tuples
            _CONTAINERS_OF[names] = found
    return found


class _SavedModule:
    """One module's class (``parametrize`` swaps it), attributes as bindings, and the contents of the
    containers nn.Module fills in place (parameters, buffers, submodules, every hook dict). Most hook
    dicts are empty: only their emptiness is kept."""

    __slots__ = ("bindings", "cls", "containers", "module")

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.cls = type(module)
        self.bindings = dict(vars(module))
        self.containers = [
            (v, v.copy() if v else None)
            for v in map(self.bindings.__getitem__, _container_names(self.bindings))
            if isinstance(v, (dict, set))
        ]

    def restore(self) -> None:
        if type(self.module) is not self.cls:
            self.module.__class__ = self.cls
        now = vars(self.module)
        if not _same_contents(now, self.bindings):
            for key in [k for k in now if k not in self.bindings]:
                del now[key]
            now.update(self.bindings)
        for container, saved in self.containers:
            if saved is None:
                if container:
                    container.clear()  # hooks (or members) the step added to an empty container
            else:
                _put_back(container, saved)


def _restore_class(cls: type, saved: dict[str, Any]) -> None:
    """A module class's own attributes as bindings: ``parametrize`` gives each parametrized module a
    class of its own and adds (or, removing a parametrization, deletes) a property on it."""
    now = dict(vars(cls))
    if _same_contents(now, saved):
        return
    for key in [k for k in now if k not in saved]:
        delattr(cls, key)
    for key, value in saved.items():
        if now.get(key, _MISSING) is not value:
            setattr(cls, key, value)


_MISSING = object()


@dataclass
class ModelState:
    params: list[torch.nn.Parameter]
    requires_grad: list[bool]
    grads: list[torch.Tensor | None]
    classes: dict[type, dict[str, Any]]
    modules: list[_SavedModule]
    tensor_hooks: list[tuple[torch.Tensor, str, Any, Any]]  # (parameter, name, hook dict, its contents)
    tensors: _SavedTensors


def snapshot_model(
    model: torch.nn.Module,
    params: list[torch.nn.Parameter] | None = None,
    modules: list[torch.nn.Module] | None = None,
) -> ModelState:
    params = list(model.parameters()) if params is None else params
    modules = list(model.modules()) if modules is None else modules
    grads = [p.grad for p in params]
    buffers = [b for m in modules for b in m._buffers.values() if b is not None]
    hooks = [
        (p, n, d, d.copy()) for p in params for n in _TENSOR_HOOKS if (d := getattr(p, n, None)) is not None
    ]
    return ModelState(
        params,
        [p.requires_grad for p in params],
        grads,
        {cls: dict(vars(cls)) for cls in {type(m) for m in modules}},
        [_SavedModule(m) for m in modules],
        hooks,
        _SavedTensors([*params, *(g for g in grads if g is not None), *buffers]),
    )


def restore_model(state: ModelState) -> None:
    # Modules first (their parameters, buffers and modes are attributes too), then values.
    for cls, saved in state.classes.items():
        _restore_class(cls, saved)
    for m in state.modules:
        m.restore()
    kept = {(id(p), n) for p, n, _, _ in state.tensor_hooks}
    for p, name, hooks, contents in state.tensor_hooks:
        if getattr(p, name, None) is not hooks:
            setattr(p, name, hooks)
        _put_back(hooks, contents)
    for p in state.params:
        for name in _TENSOR_HOOKS:
            now = getattr(p, name, None)
            if now and (id(p), name) not in kept:
                now.clear()  # hooks the step added, in a dict autograd already holds: emptied
    state.tensors.restore()
    for p, requires_grad, grad in zip(state.params, state.requires_grad, state.grads, strict=True):
        if p.requires_grad != requires_grad:
            p.requires_grad_(requires_grad)
        if p.grad is not grad:  # the very .grad object the user had (optimizers and hooks hold it)
            p.grad = grad
