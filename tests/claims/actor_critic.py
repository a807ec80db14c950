"""Advantage actor-critic on logged episodes: a shared torso, a policy head over 3 actions and a value
head. The policy-gradient term reads the advantage through ``.detach()`` on purpose (the policy term must
not train the critic); the value term trains the critic. The bug: the value loss goes through a Python
number and back (``torch.tensor(loss.item(), requires_grad=True)``, as logging code sometimes does), so
nothing trains the value head any more, and the intended detach is then the critic's only other route.

Bug: one error, at the ``.item()`` line, not at the intended detach. Fixed: no error.
"""

from __future__ import annotations

import torch
from torch import nn

from . import autograd_of, case, grown, moves, params_of, reached, truth

CASE = "a2c-value-through-item"


class ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.torso = nn.Sequential(nn.Linear(5, 20), nn.ELU())
        self.policy = nn.Linear(20, 3)
        self.critic = nn.Linear(20, 1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.distributions.Categorical, torch.Tensor]:
        h = self.torso(obs)
        return torch.distributions.Categorical(logits=self.policy(h)), self.critic(h).squeeze(-1)


def episodes() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(21)
    return {
        "obs": torch.randn(30, 5, generator=g, dtype=torch.float64),
        "act": torch.randint(0, 3, (30,), generator=g),
        "ret": torch.randn(30, generator=g, dtype=torch.float64),
    }


def a2c_losses(fixed: bool):
    def losses(agent: ActorCritic, ep: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        dist, value = agent(ep["obs"])
        advantage = ep["ret"] - value
        pg = -(dist.log_prob(ep["act"]) * advantage.detach()).mean()  # STOP a2c-value-through-item
        critic = advantage.pow(2).mean()
        if not fixed:
            critic = torch.tensor(critic.item(), requires_grad=True)  # ROOT a2c-value-through-item
        return {"pg": pg, "critic": critic, "entropy": -dist.entropy().mean()}

    return losses


@case(CASE, family="actor_critic", mechanism=".item() round trip beside an intended detach",
      expect={"graph-break-in-model"})  # fmt: skip
def build(fixed: bool):
    return grown(4, ActorCritic), a2c_losses(fixed), episodes(), {}


@truth(CASE)
def check(fixed: bool) -> None:
    agent, step, batch, _ = build(fixed)
    params = params_of(agent)
    critic = autograd_of(step(agent, batch)["critic"], params)
    pg = autograd_of(step(agent, batch)["pg"], params)
    # The intended cut exists either way: the policy term moves with the critic, no gradient reaches it.
    assert pg["critic.weight"] is None
    assert moves(lambda: step(agent, batch)["pg"], params["critic.weight"]) > 1e-9
    # The critic is trained by the value term only when the value stays a tensor.
    assert reached(critic["critic.weight"]) == fixed
    assert moves(lambda: step(agent, batch)["critic"], params["critic.weight"]) > 1e-9
