"""Two-tower retrieval with in-batch negatives: a user tower, an item tower, and a learned softmax
temperature from the user's features. Terms: in-batch cross-entropy, a small L2 on item vectors.

Bugs (chains of two cuts; the first one is the root):

- ``tower-temp-numpy-chain`` (reference step): the temperature is clipped in NumPy (line A: detach,
  ``.numpy()``) and then averaged with ``.item()`` (line B);
- ``tower-temp-data-chain`` (a user trainer path): the temperature is read through ``.data`` (A) and
  then turned into a Python number by ``.item()`` (B).

Either way the temperature head gets no gradient from any term, though the loss moves with it.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as nnf

import gradprobe

from . import autograd_of, case, grown, moves, ones_for, params_of, reached, truth, weighted

TERMS = ("in_batch_ce", "item_l2")


class TwoTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user_tower = nn.Sequential(nn.Linear(7, 20), nn.Mish(), nn.Linear(20, 8))
        self.item_tower = nn.Sequential(nn.Linear(5, 20), nn.Mish(), nn.Linear(20, 8))
        self.temp_head = nn.Linear(7, 1)

    def raw_temperature(self, user_feats: torch.Tensor) -> torch.Tensor:
        return nnf.softplus(self.temp_head(user_feats)).squeeze(-1) + 0.5


def numpy_temperature(model: TwoTower, user_feats: torch.Tensor):
    raw = model.raw_temperature(user_feats)
    clipped = np.clip(raw.detach().numpy(), 0.05, 20.0)  # ROOT tower-temp-numpy-chain
    return torch.from_numpy(clipped).mean().item()


def data_temperature(model: TwoTower, user_feats: torch.Tensor):
    frozen = model.raw_temperature(user_feats).data  # ROOT tower-temp-data-chain
    return frozen.clamp(0.05, 20.0).mean().item()


def tensor_temperature(model: TwoTower, user_feats: torch.Tensor) -> torch.Tensor:
    return model.raw_temperature(user_feats).clamp(0.05, 20.0).mean()


def clicks() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(22)
    return {
        "user_feats": torch.randn(16, 7, generator=g, dtype=torch.float64),
        "item_feats": torch.randn(16, 5, generator=g, dtype=torch.float64),
    }


def retrieval_losses(model: TwoTower, batch: dict[str, torch.Tensor], temperature) -> dict[str, torch.Tensor]:
    u = nnf.normalize(model.user_tower(batch["user_feats"]), dim=-1)
    v = model.item_tower(batch["item_feats"])
    tau = temperature(model, batch["user_feats"])
    logits = u @ nnf.normalize(v, dim=-1).T / tau
    positives = torch.arange(logits.shape[0])
    return {"in_batch_ce": nnf.cross_entropy(logits, positives), "item_l2": 1e-2 * v.pow(2).mean()}


def numpy_step(model: TwoTower, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return retrieval_losses(model, batch, numpy_temperature)


def tensor_step(model: TwoTower, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return retrieval_losses(model, batch, tensor_temperature)


def _check(step, model: TwoTower, batch, cut: bool) -> None:
    params = params_of(model)
    grads = autograd_of(step(model, batch)["in_batch_ce"], params)
    assert reached(grads["user_tower.0.weight"]) and reached(grads["item_tower.0.weight"])
    if cut:
        assert grads["temp_head.weight"] is None
        assert moves(lambda: step(model, batch)["in_batch_ce"], params["temp_head.weight"]) > 1e-9
    else:
        assert reached(grads["temp_head.weight"])


@case(
    "tower-temp-numpy-chain",
    family="retrieval",
    mechanism="numpy round trip, then .item()",
    expect={"graph-break-in-model"},
)
def build_numpy(fixed: bool):
    return grown(23, TwoTower), tensor_step if fixed else numpy_step, clicks(), {}


@truth("tower-temp-numpy-chain")
def check_numpy(fixed: bool) -> None:
    model, step, batch, _ = build_numpy(fixed)
    _check(step, model, batch, cut=not fixed)


def ranking_trainer(read_by_value: bool):
    def builder(ctx):
        model = ctx.model
        temperature = data_temperature if read_by_value else tensor_temperature

        def run(batch, weights):
            return weighted(retrieval_losses(model, batch, temperature), weights)

        return run

    return builder


@case(
    "tower-temp-data-chain",
    family="retrieval",
    mechanism=".data, then .item()",
    container="opaque-eager",
    expect={"graph-break-in-model", "flow-mismatch"},
)
def build_data(fixed: bool):
    path = gradprobe.variants.user_variant("ranking_trainer", ranking_trainer(read_by_value=not fixed))
    return grown(24, TwoTower), tensor_step, clicks(), {"variants": ["eager", path], "terms": list(TERMS)}


@truth("tower-temp-data-chain")
def check_data(fixed: bool) -> None:
    model, step, batch, kw = build_data(fixed)
    run = kw["variants"][1].builder(type("Ctx", (), {"model": model, "batch": batch})())
    only = ones_for(TERMS, ["in_batch_ce"], torch.float64)
    torch.testing.assert_close(run(batch, only)[1]["in_batch_ce"], step(model, batch)["in_batch_ce"])
    _check(lambda m, b: {"in_batch_ce": run(b, only)[0]}, model, batch, cut=not fixed)
