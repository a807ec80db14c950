"""What gradprobe is measured against: the naive loop and the floor, eager and compiled.

* naive loop (what one writes without gradprobe): per scenario ``zero_grad``, a full forward, the
  total loss with Python-float weights, ``backward()``, then ``bool(p.grad.abs().sum() > 0)`` per
  parameter (one host sync per parameter). Compiled: the same loop around ``torch.compile`` of the
  weighted step, the weights passed as Python floats.
* floor (the least work that yields every scenario's gradients): eager, one forward and one
  ``autograd.grad`` per scenario on the retained graph, nothing else; compiled, one trace-and-compile
  and k+1 forward-and-backward passes (k scenarios, plus one on the second batch, as the probe does).

The compiled paths trace with ``make_fx`` (``detach`` decomposed to an alias, as gradprobe's
``make_fx[detach=alias]`` does; see the README) and compile the traced graph with the
``aot_eager`` backend: ``torch.compile(aot_eager)`` directly around a step with
``autograd.grad(create_graph=True)`` inside fails at backward, so the naive compiled loop uses the
same pipeline as the probe's variant and differs only in how the weights enter (Python floats).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

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


# --------------------------------------------------------------------------------------- eager


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


# ------------------------------------------------------------------------------------ compiled


class CountingBackend:
    """A dynamo backend that counts the graphs it is handed (each is one compile)."""

    def __init__(self, backend: str = "aot_eager") -> None:
        from torch._dynamo import lookup_backend

        self._backend = lookup_backend(backend)
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.graphs += 1
        return self._backend(gm, example_inputs)


class _Holder(nn.Module):
    """The step as a module call, so ``functional_call`` can swap in traced parameters."""

    def __init__(self, model: nn.Module, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.model = model
        self._fn = fn

    def forward(self, *args: Any) -> Any:
        return self._fn(self.model, *args)


def _alias(x: Tensor) -> Tensor:
    return torch.ops.aten.alias.default(x)


def trace(model: nn.Module, fn: Callable[..., Any], *example: Any) -> tuple[Any, dict, dict]:
    """``make_fx`` of ``fn(model, *example)`` over (params, buffers, *example), detach -> alias.

    Returns the graph and the holder's parameter and buffer dicts (the model's own tensors).
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    holder = _Holder(model, fn)
    params, buffers = dict(holder.named_parameters()), dict(holder.named_buffers())

    def functional(p: dict, b: dict, *args: Any) -> Any:
        return functional_call(holder, {**p, **b}, args, strict=False)

    gm = make_fx(functional, decomposition_table={torch.ops.aten.detach.default: _alias})(
        params, buffers, *example
    )
    return gm, params, buffers


def floor_compiled(
    model: nn.Module,
    step: Callable[..., Any],
    batch: Any,
    second_batch: Any,
    terms: Sequence[str],
    scenarios: Scenarios,
) -> int:
    """One trace and compile, then k+1 forward-and-backward passes. Returns the graphs compiled.

    The weights enter as one 1-D tensor, unbound inside the graph: 0-dim CPU tensor inputs are
    turned into symbolic floats by dynamo on torch 2.13 and then specialised again by a
    ``TensorifyScalarRestartAnalysis``, which compiles everything twice (gradprobe's variant pays
    that; see docs/benchmarks.md). The floor is the least work, so it avoids the restart.
    """
    like = next(model.parameters())

    def tensor_weights(on: Sequence[str]) -> Tensor:
        return torch.tensor(list(float_weights(terms, on).values()), dtype=like.dtype)

    def weighted(m: nn.Module, b: Any, w: Tensor) -> Tensor:
        return weighted_total(step(m, b), dict(zip(terms, w.unbind(0), strict=True)), terms)

    gm, params, buffers = trace(model, weighted, batch, tensor_weights(terms))
    backend = CountingBackend()
    compiled = torch.compile(gm, backend=backend)
    plist = [p for p in params.values() if p.requires_grad]
    runs = [(batch, on) for _, on in scenarios] + [(second_batch, scenarios[-1][1])]
    for b, on in runs:
        total = compiled(params, buffers, b, tensor_weights(on))
        torch.autograd.grad(total, plist, allow_unused=True)
    return backend.graphs


def naive_compiled(
    model: nn.Module, step: Callable[..., Any], batch: Any, terms: Sequence[str], scenarios: Scenarios
) -> tuple[dict[str, list[str]], list[int]]:
    """The naive loop around a compiled step that takes Python-float weights.

    The terms are traced once (make_fx, detach -> alias); ``torch.compile`` wraps the step that
    weighs them with Python floats, so dynamo sees the floats. Returns what each scenario reached
    and the graphs compiled during each scenario's call.
    """
    gm, params, buffers = trace(model, step, batch)

    def naive_step(p: dict, b: dict, data: Any, weights: dict[str, float]) -> Tensor:
        return weighted_total(gm(p, b, data), weights, terms)

    backend = CountingBackend()
    compiled = torch.compile(naive_step, backend=backend)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    reached, per_scenario = {}, []
    for name, on in scenarios:
        before = backend.graphs
        model.zero_grad(set_to_none=True)
        compiled(params, buffers, batch, float_weights(terms, on)).backward()
        reached[name] = reached_by_grad(named)
        per_scenario.append(backend.graphs - before)
    return reached, per_scenario
