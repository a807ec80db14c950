"""A small GAN on a 2-D ring of points: a generator from a 4-D latent, a critic scoring points, the
non-saturating logistic losses. The critic's loss reads ``fake.detach()`` on purpose (the critic step
must not move the generator); the generator's loss reaches the generator through the critic.

Intended: no error; a ``stop-gradient`` warning, if any, at the ``# STOP`` line.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as nnf

from . import autograd_of, case, grown, moves, params_of, reached, truth

CASE = "gan-critic-on-detached-fake"


class RingGAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(4, 24), nn.LeakyReLU(0.2), nn.Linear(24, 2))
        self.critic = nn.Sequential(nn.Linear(2, 24), nn.LeakyReLU(0.2), nn.Linear(24, 1))


def ring_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(8)
    angle = 2 * math.pi * torch.rand(48, generator=g, dtype=torch.float64)
    ring = torch.stack([angle.cos(), angle.sin()], dim=-1) + 0.05 * torch.randn(
        48, 2, generator=g, dtype=torch.float64
    )
    return {"ring": ring, "latent": torch.randn(48, 4, generator=g, dtype=torch.float64)}


def adversarial_step(gan: RingGAN, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    fake = gan.generator(batch["latent"])
    score_real = gan.critic(batch["ring"])
    score_fake = gan.critic(fake.detach())  # STOP gan-critic-on-detached-fake
    critic_loss = nnf.softplus(-score_real).mean() + nnf.softplus(score_fake).mean()
    generator_loss = nnf.softplus(-gan.critic(fake)).mean()
    return {"critic": critic_loss, "generator": generator_loss}


@case(CASE, family="adversarial", mechanism="detach (GAN critic)", intended=True)
def build(fixed: bool):
    return grown(6, RingGAN), adversarial_step, ring_batch(), {}


@truth(CASE)
def check(fixed: bool) -> None:
    gan, step, batch, _ = build(fixed)
    params = params_of(gan)
    critic_grads = autograd_of(step(gan, batch)["critic"], params)
    generator_grads = autograd_of(step(gan, batch)["generator"], params)
    # The cut exists: the critic's loss moves with the generator but gets no gradient to it...
    assert critic_grads["generator.0.weight"] is None
    assert moves(lambda: step(gan, batch)["critic"], params["generator.0.weight"]) > 1e-9
    # ...and the step still reaches the generator another way.
    assert all(reached(generator_grads[k]) for k in params if k.startswith("generator."))
