"""A Wasserstein critic with a gradient penalty (WGAN-GP) on points of a 3-D shell: the penalty is the
squared distance of the critic's input gradient norm from 1 at points between real and generated ones.
The bug: the input gradient is taken without ``create_graph=True``, so the penalty is a constant to
autograd and trains nothing, while the Wasserstein term still reaches every critic parameter.

Bug: an error at the ``autograd.grad`` line whose fix is ``create_graph=True``. Fixed: no error.
"""

from __future__ import annotations

import torch
from torch import nn

from . import autograd_of, case, grown, moves, params_of, reached, truth

CASE = "wgan-gp-no-create-graph"


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Sequential(nn.Linear(3, 16), nn.Softplus(), nn.Linear(16, 16), nn.Softplus(),
                                   nn.Linear(16, 1))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.score(x).squeeze(-1)


def shell_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(33)
    real = nn.functional.normalize(torch.randn(24, 3, generator=g, dtype=torch.float64), dim=-1)
    return {
        "real": real,
        "generated": 0.5 * torch.randn(24, 3, generator=g, dtype=torch.float64),
        "mix": torch.rand(24, 1, generator=g, dtype=torch.float64),
    }


def wgan_gp(fixed: bool):
    def losses(critic: Critic, b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        between = (b["mix"] * b["real"] + (1 - b["mix"]) * b["generated"]).requires_grad_(True)
        score = critic(between).sum()
        (slope,) = torch.autograd.grad(score, between, create_graph=fixed)  # ROOT wgan-gp-no-create-graph
        return {
            "wasserstein": critic(b["generated"]).mean() - critic(b["real"]).mean(),
            "penalty": (slope.norm(dim=-1) - 1).pow(2).mean(),
        }

    return losses


@case(CASE, family="wgan_gp", mechanism="autograd.grad without create_graph",
      expect={"graph-break-in-model", "gradient-mismatch"})  # fmt: skip
def build(fixed: bool):
    return grown(9, Critic), wgan_gp(fixed), shell_batch(), {}


@truth(CASE)
def check(fixed: bool) -> None:
    critic, step, batch, _ = build(fixed)
    params = params_of(critic)
    penalty = autograd_of(step(critic, batch)["penalty"], params)
    # (the last bias shifts the score, not its slope: no term but the Wasserstein one can reach it)
    assert all(reached(g) for k, g in penalty.items() if k != "score.4.bias") == fixed
    # The penalty moves with the critic's parameters either way: the bug loses that dependence.
    assert moves(lambda: step(critic, batch)["penalty"], params["score.0.weight"]) > 1e-9
    wasserstein = autograd_of(step(critic, batch)["wasserstein"], params)
    assert all(reached(g) for k, g in wasserstein.items() if k != "score.4.bias")  # a shift cancels there
