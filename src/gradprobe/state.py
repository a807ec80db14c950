"""Leave the user's objects exactly as found: parameters, ``.grad``, ``requires_grad``, train/eval mode,
buffers, RNG streams, grad mode and the global torch settings a step or a compile may change (default
dtype, deterministic algorithms, anomaly mode, float32 matmul precision, ``torch.autograd.grad``, and the
dynamo / inductor / functorch / compiler config values) are saved before a probe and restored after it,
even on error and on ``KeyboardInterrupt`` (which is re-raised, never recorded).

Cost: one copy of the parameters, ``.grad`` and buffers (on their own device) for the duration of the
probe, written back once at the end (one read of the copy and one write, no comparison and no host
sync: cheaper than checking what changed, and it also undoes what no version counter records), and a
copy of the already imported compiler config modules (about a millisecond). The write-back goes through
aliases with version counters of their own, so a tensor the step left alone keeps its ``_version``.
Tensor subclasses and overlapping or conjugate views are compared first and written only if changed.
(Writing also dirties the pages of a model memory-mapped from a file, ``torch.load(mmap=True)``: they
become private memory, as any write would make them.)
"""

from __future__ import annotations

import importlib
import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

_PLAIN = (torch.Tensor, torch.nn.Parameter)


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
        self.aliases = [t.data for t in tensors]
        self.copies = [t.detach().clone() for t in tensors]

    def restore(self) -> None:
        """Each tensor back on its own storage, offset, sizes, strides and dtype, with its saved values.

        Values are written back whether or not they changed: a change no version counter sees
        (``p.data.mul_(2)``, an in-kernel update of BatchNorm's running statistics, a write through
        NumPy) is undone like any other, and one write costs less than comparing first. The writes go
        through the aliases, whose version counters are their own: a tensor the step left alone keeps
        its ``_version``, so autograd graphs that saved it before the probe stay usable.
        """
        write: list[int] = []
        compare: list[int] = []
        for i, (t, alias) in enumerate(zip(self.tensors, self.aliases, strict=True)):
            if alias.layout != torch.strided:  # sparse and other layouts: no storage to write into
                t.data = self.copies[i]
                continue
            if _replaced(t, alias):
                t.data = alias
            (write if _writable(t, alias) else compare).append(i)
        if write:
            torch._foreach_copy_([self.aliases[i] for i in write], [self.copies[i] for i in write])
        if compare:
            current = [self.aliases[i] for i in compare]
            for i, changed in zip(compare, _changed(current, [self.copies[i] for i in compare]), strict=True):
                if changed:
                    _copy_into(self.aliases[i], self.copies[i])


@dataclass
class _ModelState:
    params: list[torch.nn.Parameter]
    requires_grad: list[bool]
    grads: list[torch.Tensor | None]
    buffers: list[tuple[dict[str, torch.Tensor | None], str, torch.Tensor | None]]
    modes: list[tuple[torch.nn.Module, bool]]
    saved: _Saved


def _snapshot_model(model: torch.nn.Module) -> _ModelState:
    params = list(model.parameters())
    grads = [p.grad for p in params]
    modules = list(model.modules())
    buffers = [(m._buffers, name, b) for m in modules for name, b in m._buffers.items()]
    tensors: list[torch.Tensor] = [*params, *(g for g in grads if g is not None)]
    tensors += [b for _, _, b in buffers if b is not None]
    with torch.no_grad():
        saved = _Saved(tensors)
    return _ModelState(
        params, [p.requires_grad for p in params], grads, buffers, [(m, m.training) for m in modules], saved
    )


def _restore_model(state: _ModelState) -> None:
    with torch.no_grad():
        state.saved.restore()
        for p, requires_grad, grad in zip(state.params, state.requires_grad, state.grads, strict=True):
            if p.requires_grad != requires_grad:
                p.requires_grad_(requires_grad)
            # The very .grad object the user had (optimizers and hooks may hold it), values as they were.
            if p.grad is not grad:
                p.grad = grad
        for module_buffers, name, b in state.buffers:
            module_buffers[name] = b
    for module, training in state.modes:
        if module.training != training:
            module.training = training


@dataclass
class _RngState:
    torch_cpu: torch.Tensor
    cuda: list[torch.Tensor] | None
    python: Any
    numpy: Any


def _snapshot_rng() -> _RngState:
    cuda = (
        torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    )
    np_state = None
    np = sys.modules.get("numpy")
    if np is not None:
        np_state = np.random.get_state()
    return _RngState(torch.get_rng_state(), cuda, random.getstate(), np_state)


def _restore_rng(state: _RngState) -> None:
    torch.set_rng_state(state.torch_cpu)
    if state.cuda is not None:
        torch.cuda.set_rng_state_all(state.cuda)
    random.setstate(state.python)
    if state.numpy is not None:
        sys.modules["numpy"].random.set_state(state.numpy)


# Config modules restored value by value when already imported before the probe (a compile imports
# them; a step may set e.g. ``torch._dynamo.config.recompile_limit``; gradprobe itself only patches
# ``torch._inductor.config.fallback_random`` inside a context manager).
CONFIG_MODULES = (
    "torch._dynamo.config",
    "torch._inductor.config",
    "torch._functorch.config",
    "torch.compiler.config",
)


@dataclass
class _Settings:
    grad_enabled: bool
    default_dtype: torch.dtype
    deterministic: tuple[bool, bool]  # enabled, warn_only
    anomaly: tuple[bool, bool]  # enabled, check_nan
    matmul_precision: str
    autograd_grad: Any
    configs: list[tuple[Any, dict[str, Any]]]


def _config_values(module: Any) -> dict[str, Any] | None:
    try:
        return module.get_config_copy()  # a deep copy of the values that are not immutable
    except Exception:  # a value someone set that cannot be copied: leave this module alone
        return None


def _snapshot_settings() -> _Settings:
    configs = []
    for name in CONFIG_MODULES:
        module = sys.modules.get(name)
        values = _config_values(module) if hasattr(module, "get_config_copy") else None
        if values is not None:
            configs.append((module, values))
    return _Settings(
        torch.is_grad_enabled(),
        torch.get_default_dtype(),
        (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        torch.get_float32_matmul_precision(),
        torch.autograd.grad,
        configs,
    )


def _restore_settings(state: _Settings) -> None:
    torch.set_grad_enabled(state.grad_enabled)
    if torch.get_default_dtype() != state.default_dtype:
        torch.set_default_dtype(state.default_dtype)
    now = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    if now != state.deterministic:
        torch.use_deterministic_algorithms(state.deterministic[0], warn_only=state.deterministic[1])
    if (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()) != state.anomaly:
        torch.autograd.set_detect_anomaly(*state.anomaly)
    if torch.get_float32_matmul_precision() != state.matmul_precision:
        torch.set_float32_matmul_precision(state.matmul_precision)
    if torch.autograd.grad is not state.autograd_grad:
        torch.autograd.grad = state.autograd_grad
    for module, saved in state.configs:
        current = _config_values(module)
        for key, value in saved.items():
            try:
                now = current[key] if current is not None else getattr(module, key)
                if now is not value and bool(now != value):
                    setattr(module, key, value)
            except Exception:  # a key gone, or values that cannot be compared: leave it
                continue


@contextmanager
def preserved(model: torch.nn.Module) -> Iterator[None]:
    """Run the body, then put the model, the RNG streams and the global settings back as they were."""
    model_state = _snapshot_model(model)
    rng_state = _snapshot_rng()
    settings = _snapshot_settings()
    try:
        yield
    finally:
        # Each part is restored even if another fails. A failure to restore is raised after all ran,
        # unless the body is already raising (its exception, a KeyboardInterrupt say, goes on).
        errors: list[BaseException] = []
        for restore, state in (
            (_restore_settings, settings),
            (_restore_rng, rng_state),
            (_restore_model, model_state),
        ):
            try:
                restore(state)  # type: ignore[operator]
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
    settings = _snapshot_settings()
    try:
        yield
    finally:
        _restore_settings(settings)


def reseed(seed: int) -> None:
    """Seed every RNG a step may draw from, so each run sees the same random stream."""
    torch.manual_seed(seed)  # also seeds every CUDA device
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed % 2**32)
