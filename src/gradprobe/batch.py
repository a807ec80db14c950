"""Looking inside the user's batch: where its tensors live, and preparing differentiated inputs."""

from __future__ import annotations

import copy
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from .errors import SpecError, did_you_mean

_DEVICE = operator.attrgetter("device")


def tensors_in(batch: Any, path: str = "batch") -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor in nested dicts, lists and tuples."""
    return _walk(batch, path)  # type: ignore[return-value]


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    """The tensors of ``tensors_in`` without their paths (spelled only for an error message)."""
    return [t for _, t in _walk(batch, None)]


def _walk(batch: Any, path: str | None) -> Iterator[tuple[str | None, torch.Tensor]]:
    """``tensors_in``; with ``path`` None no path is spelled (a string per tensor saved)."""
    if isinstance(batch, torch.Tensor):
        yield path, batch
    elif isinstance(batch, Mapping):
        for k, v in batch.items():
            yield from _walk(v, None if path is None else f"{path}[{k!r}]")
    elif isinstance(batch, list | tuple):
        for i, v in enumerate(batch):
            yield from _walk(v, None if path is None else f"{path}[{i}]")


_IS_INFERENCE = torch.Tensor.is_inference


def check_not_inference(
    batch: Any, named: Sequence[tuple[str, torch.Tensor]], tensors: Sequence[torch.Tensor] | None = None
) -> None:
    """Inference tensors (made under ``torch.inference_mode()``) can never be recorded by autograd, not
    even after leaving inference mode: a clear error instead of "nothing reached". ``tensors``: the
    batch's (``batch_tensors``) when the caller has them."""
    in_batch = batch_tensors(batch) if tensors is None else tensors
    if not any(map(_IS_INFERENCE, (p for _, p in named))) and not any(map(_IS_INFERENCE, in_batch)):
        return  # the usual case, without a path spelled per tensor
    for name, p in named:
        if p.is_inference():
            raise SpecError(
                f"parameter {name} is an inference tensor (made under torch.inference_mode()): autograd can "
                "never record it. Build or load the model outside torch.inference_mode(), or replace its "
                "parameters by clones made outside it"
            )
    for path, t in tensors_in(batch):
        if t.is_inference():
            raise SpecError(
                f"{path} is an inference tensor (made under torch.inference_mode()): autograd cannot "
                f"differentiate through it. Make the batch outside inference mode, or pass {path}.clone() "
                "made outside it"
            )


def check_devices(
    batch: Any,
    model: torch.nn.Module,
    params: Iterable[torch.Tensor] | None = None,
    tensors: Sequence[torch.Tensor] | None = None,
) -> None:
    """A batch tensor on another device than the (single-device) model is a clear error.

    ``params``: the model's parameters when the caller has listed them already (a module walk saved);
    ``tensors``: the batch's (``batch_tensors``).
    """
    devices = set(map(_DEVICE, model.parameters() if params is None else params))
    if len(devices) != 1:
        return  # model-parallel: the step moves data itself
    (device,) = devices
    in_batch = batch_tensors(batch) if tensors is None else tensors
    if all(t.device == device or t.dim() == 0 for t in in_batch):
        return  # the usual case, without a path spelled per tensor
    for path, t in tensors_in(batch):
        if t.device != device and t.dim() > 0:
            raise SpecError(
                f"{path} is on {t.device} but the model's parameters are on {device}: move the batch "
                f"(.to({str(device)!r})) or the model so that both are on one device"
            )


def with_differentiable_inputs(batch: Any, keys: Sequence[str]) -> Any:
    """A shallow copy of a dict batch whose ``keys`` are fresh leaf clones with ``requires_grad``.

    The user's tensors are never modified; each run gets its own leaves.
    """
    if not keys:
        return batch
    if not isinstance(batch, Mapping):
        raise SpecError(
            f"differentiable_inputs={list(keys)} needs a dict batch, got {type(batch).__name__}: "
            "set requires_grad_ inside the step instead"
        )
    out = dict(batch)
    for k in keys:
        if k not in batch:
            raise SpecError(
                f"differentiable input {k!r} is not in the batch{did_you_mean(k, map(str, batch))}; "
                f"keys are: {', '.join(map(str, batch))}"
            )
        t = batch[k]
        if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()):
            raise SpecError(
                f"differentiable input {k!r} must be a floating-point tensor, got "
                f"{getattr(t, 'dtype', type(t).__name__)}"
            )
        out[k] = t.detach().clone().requires_grad_(True)
    return out


def as_float64(x: Any) -> Any:
    """The batch with every floating tensor in float64 (a differentiable input stays a leaf that
    requires grad), in nested dicts, lists, tuples and PyG ``Data``/``Batch`` objects (through their
    own ``apply``, on a copy); the batch itself is not written."""
    if isinstance(x, torch.Tensor):
        return x.detach().double().requires_grad_(x.requires_grad) if x.is_floating_point() else x
    if isinstance(x, Mapping):
        return (
            type(x)({k: as_float64(v) for k, v in x.items()})
            if type(x) is dict
            else {k: as_float64(v) for k, v in x.items()}
        )
    if isinstance(x, list | tuple) and not hasattr(x, "_fields"):
        return type(x)(as_float64(v) for v in x)
    if callable(getattr(x, "apply", None)) and callable(getattr(x, "keys", None)):  # a PyG Data
        return copy.copy(x).apply(as_float64)
    return x
