"""Tabular regression of concrete compressive strength from its mix (cement, slag, water, age...):
a two-layer network with a hand-written softplus (a ``torch.autograd.Function``), a mean head and a
0.9-quantile head. Terms: squared error of the mean, pinball loss of the quantile.

Three bugs:

- ``tab-softplus-backward``: the Function's backward is 0.9 times the derivative. Every status is
  right; only finite differences see it. The ROOT marker is on the line that calls ``.apply``.
- ``tab-shadow-copy``: a user trainer path whose builder deep-copies the model and trains the copy.
- ``tab-snapshot-clone``: a compiled user path that calls the network through ``functional_call``
  with detached clones of its parameters (a weight snapshot meant for evaluation).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as nnf

import gradprobe

from . import (
    autograd_of,
    case,
    fd_vs_autograd,
    grown,
    new_code,
    ones_for,
    params_of,
    reached,
    truth,
    weighted,
    worst_disagreement,
)

FEATURES = 8
TERMS = ("sq_err", "pinball")


class SoftplusExact(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return nnf.softplus(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * torch.sigmoid(x)


class SoftplusCheap(torch.autograd.Function):
    """A "fast" softplus whose derivative was fitted once and is 10% short."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return nnf.softplus(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 0.9 * grad * torch.sigmoid(x)


class StrengthNet(nn.Module):
    def __init__(self, act: type[torch.autograd.Function] = SoftplusExact) -> None:
        super().__init__()
        self.act = act
        self.first = nn.Linear(FEATURES, 20)
        self.second = nn.Linear(20, 20)
        self.mean_head = nn.Linear(20, 1)
        self.q90_head = nn.Linear(20, 1)

    def forward(self, mix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.act.apply(self.first(mix))  # ROOT tab-softplus-backward
        h = torch.tanh(self.second(h))
        return self.mean_head(h).squeeze(-1), self.q90_head(h).squeeze(-1)


def mix_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(21)
    mix = torch.rand(40, FEATURES, generator=g, dtype=torch.float64)
    strength = (
        3.0 * mix[:, 0]
        - 2.0 * mix[:, 3]
        + torch.log1p(5 * mix[:, 7])
        + 0.1 * torch.randn(40, generator=g, dtype=torch.float64)
    )
    return {"mix": mix, "mpa": strength}


def strength_losses(net: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    mean, q90 = net(batch["mix"])
    miss = batch["mpa"] - q90
    return {
        "sq_err": ((mean - batch["mpa"]) ** 2).mean(),
        "pinball": torch.maximum(0.9 * miss, -0.1 * miss).mean(),
    }


# ----- tab-softplus-backward ----------------------------------------------------------------------


@case(
    "tab-softplus-backward",
    family="tabular",
    mechanism="custom Function backward x0.9",
    expect={"gradient-mismatch"},
    severity="warning",  # a surrogate gradient is meant to differ: the tool asks (issue 32)
)
def build_softplus(fixed: bool):
    act = SoftplusExact if fixed else SoftplusCheap
    return grown(3, lambda: StrengthNet(act)), strength_losses, mix_batch(), {}


@truth("tab-softplus-backward")
def check_softplus(fixed: bool) -> None:
    net, step, batch, _ = build_softplus(fixed)
    params = params_of(net)
    grads = autograd_of(step(net, batch)["sq_err"], params)
    assert all(reached(g) for k, g in grads.items() if not k.startswith("q90_head."))
    pairs = fd_vs_autograd(lambda: step(net, batch)["sq_err"], params)
    off = worst_disagreement(pairs)
    if fixed:
        assert off < 1e-6, off
    else:
        assert off > 0.02, off
        fd, ad = pairs["first.weight"]  # everything below the activation is 0.9 times too small
        assert abs(ad / fd - 0.9) < 1e-4, (fd, ad)


# ----- tab-shadow-copy ------------------------------------------------------------------------------


def shadow_trainer(copy_model: bool):
    def builder(ctx):
        if copy_model:  # noqa: SIM108 (the ROOT line stays alone)
            net = copy.deepcopy(ctx.model)  # ROOT tab-shadow-copy
        else:
            net = ctx.model

        def run(batch, weights):
            return weighted(strength_losses(net, batch), weights)

        return run

    return builder


@case(
    "tab-shadow-copy",
    family="tabular",
    mechanism="deepcopy of the model in a user path",
    container="opaque-eager",
    expect={"flow-mismatch", "graph-break-in-model"},
)
def build_shadow(fixed: bool):
    net = grown(4, StrengthNet)
    path = gradprobe.variants.user_variant("shadow_trainer", shadow_trainer(copy_model=not fixed))
    return net, strength_losses, mix_batch(), {"variants": ["eager", path], "terms": list(TERMS)}


def _context(net: nn.Module, batch) -> object:
    return type("Ctx", (), {"model": net, "batch": batch})()


@truth("tab-shadow-copy")
def check_shadow(fixed: bool) -> None:
    net, step, batch, kw = build_shadow(fixed)
    run = kw["variants"][1].builder(_context(net, batch))
    total, values = run(batch, ones_for(TERMS, TERMS, torch.float64))
    torch.testing.assert_close(values["sq_err"], step(net, batch)["sq_err"])
    grads = autograd_of(total, params_of(net))
    assert all(reached(g) for g in grads.values()) == fixed, grads


# ----- tab-snapshot-clone ---------------------------------------------------------------------------


def snapshot_trainer(snapshot: bool):
    def builder(ctx):
        net = ctx.model

        def losses(batch, weights):
            if snapshot:
                state = {k: v.detach().clone() for k, v in net.named_parameters()}  # ROOT tab-snapshot-clone
            else:
                state = dict(net.named_parameters())
            mean, q90 = functional_call(net, state, (batch["mix"],))
            miss = batch["mpa"] - q90
            terms = {
                "sq_err": ((mean - batch["mpa"]) ** 2).mean(),
                "pinball": torch.maximum(0.9 * miss, -0.1 * miss).mean(),
            }
            return weighted(terms, weights)

        return torch.compile(new_code(losses), backend="eager")

    return builder


@case(
    "tab-snapshot-clone",
    family="tabular",
    mechanism="detached clones through functional_call",
    container="opaque-compiled",
    expect={"flow-mismatch", "graph-break-in-model"},
)
def build_snapshot(fixed: bool):
    net = grown(5, StrengthNet)
    path = gradprobe.variants.user_variant("snapshot_trainer", snapshot_trainer(snapshot=not fixed))
    return net, strength_losses, mix_batch(), {"variants": ["eager", path], "terms": list(TERMS)}


@truth("tab-snapshot-clone")
def check_snapshot(fixed: bool) -> None:
    net, step, batch, kw = build_snapshot(fixed)
    run = kw["variants"][1].builder(_context(net, batch))
    total, values = run(batch, ones_for(TERMS, TERMS, torch.float64))
    torch.testing.assert_close(values["pinball"], step(net, batch)["pinball"])
    grads = autograd_of(total, params_of(net))
    assert all(reached(g) for g in grads.values()) == fixed, grads
