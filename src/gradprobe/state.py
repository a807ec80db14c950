"""Leave the user's objects exactly as found: parameters, ``.grad``, ``requires_grad``, train/eval mode,
buffers, RNG streams, grad mode and the global torch settings a step or a compile may change (default
dtype, deterministic algorithms, anomaly mode, float32 matmul precision, ``torch.autograd.grad``, and the
dynamo / inductor / functorch / compiler config values) are saved before a probe and restored after it,
even on error and on ``KeyboardInterrupt`` (which is re-raised, never recorded).

Cost: one copy of the parameters and buffers (on their own device) for the duration of the probe, and
a copy of the already imported compiler config modules (about a millisecond).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class _TensorSlot:
    """A tensor object and a copy of its values, to put the values back if anything changed them."""

    tensor: torch.Tensor
    copy: torch.Tensor
    data_ptr: int

    @classmethod
    def of(cls, t: torch.Tensor) -> _TensorSlot:
        return cls(t, t.detach().clone(), t.data_ptr())

    def replaced(self) -> bool:
        """The storage was swapped (``p.data = ...``) or reshaped: values cannot be compared in place."""
        return self.tensor.data_ptr() != self.data_ptr or self.tensor.shape != self.copy.shape

    def restore(self, changed: bool) -> torch.Tensor:
        t = self.tensor
        if self.replaced():
            t.data = self.copy
        elif changed:
            t.detach().copy_(self.copy)
        return t


def _changed(slots: list[_TensorSlot]) -> list[bool]:
    """Which slots' values differ from their copies, found with batched reductions and one host sync
    per device. Version counters alone miss in-kernel updates (BatchNorm's running statistics)."""
    changed = [s.replaced() for s in slots]
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, s in enumerate(slots):
        if not changed[i] and s.copy.numel():
            groups.setdefault((s.copy.device, s.copy.dtype), []).append(i)
    for idx in groups.values():
        current = [slots[i].tensor.detach() for i in idx]
        copies = [slots[i].copy for i in idx]
        if current[0].is_floating_point() or current[0].is_complex():
            # One read of both, no temporary copy (a _foreach_sub + inf-norm writes a full copy and
            # reads it again, with a slow inf-norm kernel on CPU). NaN != NaN: such a slot reads as
            # changed and is copied back, which is harmless.
            flags = torch.stack([(c != k).any() for c, k in zip(current, copies, strict=True)]).cpu().tolist()
        else:
            flags = [not torch.equal(c, k) for c, k in zip(current, copies, strict=True)]
        for i, flag in zip(idx, flags, strict=True):
            changed[i] = bool(flag)
    return changed


@dataclass
class _ModelState:
    params: list[tuple[torch.nn.Parameter, _TensorSlot, bool, _TensorSlot | None]]
    buffers: list[tuple[torch.nn.Module, str, _TensorSlot | None]]
    modes: list[tuple[torch.nn.Module, bool]]


def _snapshot_model(model: torch.nn.Module) -> _ModelState:
    with torch.no_grad():
        params = [
            (p, _TensorSlot.of(p), p.requires_grad, None if p.grad is None else _TensorSlot.of(p.grad))
            for p in model.parameters()
        ]
        buffers = [
            (module, name, None if b is None else _TensorSlot.of(b))
            for module in model.modules()
            for name, b in module._buffers.items()
        ]
    modes = [(m, m.training) for m in model.modules()]
    return _ModelState(params, buffers, modes)


def _restore_model(state: _ModelState) -> None:
    with torch.no_grad():
        slots = [v for _, v, _, _ in state.params]
        slots += [g for _, _, _, g in state.params if g is not None]
        slots += [b for _, _, b in state.buffers if b is not None]
        changed = dict(zip(map(id, slots), _changed(slots), strict=True))
        for p, value, requires_grad, grad in state.params:
            value.restore(changed[id(value)])
            if p.requires_grad != requires_grad:
                p.requires_grad_(requires_grad)
            # The very .grad object the user had (optimizers and hooks may hold it), values as they were.
            p.grad = None if grad is None else grad.restore(changed[id(grad)])
        for module, name, slot in state.buffers:
            module._buffers[name] = None if slot is None else slot.restore(changed[id(slot)])
    for module, training in state.modes:
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


def reseed(seed: int) -> None:
    """Seed every RNG a step may draw from, so each run sees the same random stream."""
    torch.manual_seed(seed)  # also seeds every CUDA device
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed % 2**32)
