"""Optimizers for checks: built from the spec on copies, never on the user's parameters, never stepped.

* ``plan``: which optimizer the spec trains with and each trainable parameter's hyperparameters (its
  group's ``lr``, ``betas``, ...; ``None`` for a parameter in no group), read from the user's
  optimizer instance (read only) or from the factory called on a meta-device twin of the model: a
  factory's hooks and side effects on parameters land on the twin, and it costs no memory.
* ``fresh_optimizer``: a new optimizer of the spec's kind on copies (the training check).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from .copies import meta_twin, model_copy
from .errors import SpecError
from .spec import ProbeSpec

# Optimizers whose step treats each parameter tensor on its own (per-tensor state, no norm over the
# whole model): stepping them one tensor at a time gives the same update with memory for one tensor.
SEPARABLE = frozenset(
    getattr(torch.optim, name)
    for name in (
        "SGD",
        "Adam",
        "AdamW",
        "Adamax",
        "NAdam",
        "RAdam",
        "RMSprop",
        "Rprop",
        "Adagrad",
        "Adadelta",
    )
    if hasattr(torch.optim, name)
)


def call_optimizer_factory(factory: Any, params: list[torch.Tensor], model: torch.nn.Module) -> Any:
    """``factory(params)``, or ``factory(model)`` when its first parameter is named ``model`` (filters
    by parameter name need the names). A factory that raises is bad input: a ``SpecError``."""
    try:
        first = next(iter(inspect.signature(factory).parameters), "")
    except (TypeError, ValueError):
        first = ""
    try:
        opt = factory(model) if first == "model" else factory(params)
    except Exception as e:
        raise SpecError(
            f"the optimizer factory raised {type(e).__name__}: {e}. It is called as factory(params) (or "
            "factory(model) when its first parameter is named model) and must return a torch.optim.Optimizer"
        ) from e
    if not isinstance(opt, torch.optim.Optimizer):
        raise SpecError(
            f"the optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer: return e.g. "
            "torch.optim.Adam(params, lr=1e-3)"
        )
    return opt


@dataclass(frozen=True)
class Plan:
    """The optimizer's class and, per trainable parameter, its group's hyperparameters (None: the
    parameter is in no group)."""

    cls: type[torch.optim.Optimizer]
    groups: list[dict[str, Any] | None]
    given: bool  # the spec named an optimizer (else: Adam, lr 1e-3, as a default for the checks)

    @property
    def separable(self) -> bool:
        return self.cls in SEPARABLE

    def on(self, tensors: list[torch.Tensor], indices: list[int]) -> torch.optim.Optimizer:
        """A fresh optimizer of this kind on ``tensors``, each with the hyperparameters of the
        parameter at the same place in ``indices`` (parameters in no group get the defaults)."""
        groups = [{"params": [t], **(self.groups[i] or {})} for t, i in zip(tensors, indices, strict=True)]
        return self.cls(groups)


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def plan(spec: ProbeSpec, model: torch.nn.Module) -> Plan:
    """The optimizer the spec trains with, per trainable parameter; the live parameters are only read."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = spec.optimizer
    if opt is None:
        return Plan(torch.optim.Adam, [{"lr": 1e-3, "foreach": False}] * len(params), False)
    if isinstance(opt, torch.optim.Optimizer):
        by_id = {id(p): _hyperparameters(g) for g in opt.param_groups for p in g["params"]}
        return Plan(type(opt), [by_id.get(id(p)) for p in params], True)
    twin = meta_twin(model)
    stand_ins = [p for p in twin.parameters() if p.requires_grad]
    try:
        built = call_optimizer_factory(opt, stand_ins, twin)
    except SpecError:
        # Some factories need real tensors (fused=True checks the device; a filter reads values): a
        # real copy then, still never the user's parameters. Raising there too is bad input.
        real = model_copy(model)
        stand_ins = [p for p in real.parameters() if p.requires_grad]
        built = call_optimizer_factory(opt, stand_ins, real)
    by_id = {id(p): _hyperparameters(g) for g in built.param_groups for p in g["params"]}
    return Plan(type(built), [by_id.get(id(p)) for p in stand_ins], True)


def fresh_optimizer(
    spec: ProbeSpec, params: list[torch.Tensor], model: torch.nn.Module
) -> torch.optim.Optimizer:
    """A new optimizer of the spec's kind on ``params`` (copies: the user's are never handed over);
    Adam, lr 1e-3, when the spec names none; for a user's optimizer instance, a fresh one of its class
    with its groups' hyperparameters."""
    opt = spec.optimizer
    if opt is None:
        return torch.optim.Adam(params, lr=1e-3, foreach=False)
    if isinstance(opt, torch.optim.Optimizer):
        return type(opt)(params, **opt.defaults)
    return call_optimizer_factory(opt, params, model)
