"""Deep Q-learning on transitions of a small control task: a Q-network over 6-D observations and 3
actions; the TD target bootstraps from the same network under ``torch.no_grad()`` (a semi-gradient
method, as in DQN without a separate target copy); a conservative regulariser (CQL) pushes down the
log-sum-exp of all Q-values against the taken action's.

Intended: no error; a ``stop-gradient`` warning, if any, at a ``# STOP`` line.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as nnf

from . import autograd_of, case, grown, moves, params_of, reached, truth

CASE = "dqn-bootstrap-no-grad"
GAMMA = 0.97


class QNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.torso = nn.Sequential(nn.Linear(6, 32), nn.SiLU(), nn.Linear(32, 32), nn.SiLU())
        self.values = nn.Linear(32, 3)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.values(self.torso(obs))


def transitions() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(10)
    n = 40
    return {
        "obs": torch.randn(n, 6, generator=g, dtype=torch.float64),
        "action": torch.randint(0, 3, (n,), generator=g),
        "reward": torch.randn(n, generator=g, dtype=torch.float64),
        "next_obs": torch.randn(n, 6, generator=g, dtype=torch.float64),
        "done": (torch.rand(n, generator=g) < 0.1).double(),
    }


def td_step(qnet: QNet, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    q_all = qnet(batch["obs"])
    q_taken = q_all.gather(1, batch["action"][:, None]).squeeze(1)
    with torch.no_grad():  # STOP dqn-bootstrap-no-grad
        bootstrap = qnet(batch["next_obs"]).max(dim=1).values  # STOP dqn-bootstrap-no-grad
    target = batch["reward"] + GAMMA * (1 - batch["done"]) * bootstrap
    return {
        "td": nnf.smooth_l1_loss(q_taken, target),
        "cql": (torch.logsumexp(q_all, dim=1) - q_taken).mean(),
    }


@case(CASE, family="q_learning", mechanism="no_grad (bootstrapped target)", intended=True)
def build(fixed: bool):
    return grown(12, QNet), td_step, transitions(), {}


@truth(CASE)
def check(fixed: bool) -> None:
    qnet, step, batch, _ = build(fixed)
    params = params_of(qnet)
    assert all(reached(g) for g in autograd_of(step(qnet, batch)["td"], params).values())
    # The cut exists: the target moves with the parameters, its gradient is not taken (the full
    # residual gradient differs from the semi-gradient the step gives).
    q_all = qnet(batch["obs"])
    q_taken = q_all.gather(1, batch["action"][:, None]).squeeze(1)
    target = batch["reward"] + GAMMA * (1 - batch["done"]) * qnet(batch["next_obs"]).max(dim=1).values
    residual = autograd_of(nnf.smooth_l1_loss(q_taken, target), params)
    semi = autograd_of(step(qnet, batch)["td"], params)
    assert not torch.allclose(residual["values.weight"], semi["values.weight"])  # type: ignore[arg-type]
    assert moves(lambda: step(qnet, batch)["td"], params["values.weight"]) > 1e-9
