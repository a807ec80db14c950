"""What gradprobe is measured against (eager): the naive loop and the floor.

* naive loop (what one writes without gradprobe): per scenario ``zero_grad``, a full forward, the
  total loss with Python-float weights, ``backward()``, then ``bool(p.grad.abs().sum() > 0)`` per
  parameter (one host sync per parameter).
* floor (the least work that yields every scenario's gradients): one forward and one
  ``autograd.grad`` per scenario on the retained graph, nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

Scenarios = Sequence[tuple[str, tuple[str, ...]]]  # (name, terms switched on)


def default_scenarios(terms: Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
    """Each term alone, then all (gradprobe's defaults)."""
    return [(f"{t} only", (t,)) for t in terms] + [("all", tuple(terms))]


def float_weights(terms: Sequence[str], on: Sequence[str]) -> dict[str, float]:
    return {t: 1.0 if t in on else 0.0 for t in terms}


def weighted_total(values: Mapping[str, Tensor], weights: Mapping[str, Any], terms: Sequence[str]) -> Tensor:
    total = weights[terms[0]] * values[terms[0]]
    for t in terms[1:]:
        total = total + weights[t] * values[t]
    return total


def reached_by_grad(named: Sequence[tuple[str, nn.Parameter]]) -> list[str]:
    """The naive check: one ``bool(...)`` (a host sync) per parameter."""
    return [n for n, p in named if p.grad is not None and bool(p.grad.abs().sum() > 0)]


def naive_eager(
    model: nn.Module, step: Callable[..., Any], batch: Any, terms: Sequence[str], scenarios: Scenarios
) -> dict[str, list[str]]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    reached = {}
    for name, on in scenarios:
        weights = float_weights(terms, on)
        model.zero_grad(set_to_none=True)
        values = step(model, batch)
        weighted_total(values, weights, terms).backward()
        reached[name] = reached_by_grad(named)
    return reached


def floor_eager(model: nn.Module, step: Callable[..., Any], batch: Any, scenarios: Scenarios) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    values = step(model, batch)
    for i, (_, on) in enumerate(scenarios):
        loss = values[on[0]]
        for t in on[1:]:
            loss = loss + values[t]
        torch.autograd.grad(loss, params, retain_graph=i < len(scenarios) - 1, allow_unused=True)
