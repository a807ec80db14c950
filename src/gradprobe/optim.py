"""Optimizers for checks: built from the spec, on copies or for reading only, never the user's stepped."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .spec import ProbeSpec


def call_optimizer_factory(factory: Any, params: list[torch.Tensor], model: torch.nn.Module) -> Any:
    """``factory(params)``, or ``factory(model)`` when its first parameter is named ``model`` (filters
    by parameter name need the names)."""
    try:
        first = next(iter(inspect.signature(factory).parameters), "")
    except (TypeError, ValueError):
        first = ""
    return factory(model) if first == "model" else factory(params)


def fresh_optimizer(
    spec: ProbeSpec, params: list[torch.Tensor], model: torch.nn.Module
) -> torch.optim.Optimizer:
    """A new optimizer of the spec's kind on ``params`` (Adam, lr 1e-3, when the spec names none); for a
    user's optimizer instance, a fresh one of its class and hyperparameters: the user's is never stepped."""
    opt = spec.optimizer
    if opt is None:
        return torch.optim.Adam(params, lr=1e-3)
    if isinstance(opt, torch.optim.Optimizer):
        return type(opt)(params, **opt.defaults)
    return call_optimizer_factory(opt, params, model)
