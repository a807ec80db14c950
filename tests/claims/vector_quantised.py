"""A VQ-VAE on short spectra: an encoder, a codebook of 8 vectors picked by nearest neighbour, a
decoder fed through the straight-through estimator (``z + (e - z).detach()``), and the usual codebook
and commitment terms, each with its own intended ``.detach()``. The bug: the codebook term detaches
both sides (a refactor that "made the loss safe"), so nothing trains the codebook any more and the
two intended detaches beside it are then the codebook's only other routes.

Bug: one error, at the codebook term's line; the intended detaches stay questions (warnings) that name
it. Fixed: no error.
"""

from __future__ import annotations

import torch
from torch import nn

from . import autograd_of, case, grown, moves, params_of, reached, truth

CASE = "vq-codebook-term-detached"


class SpectrumVQ(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))
        self.codebook = nn.Parameter(torch.randn(8, 3))
        self.decoder = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 12))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        z = self.encoder(x)
        e = self.codebook[torch.cdist(z, self.codebook).argmin(-1)]
        st = z + (e - z).detach()  # STOP vq-codebook-term-detached
        return z, e, self.decoder(st)


def spectra() -> torch.Tensor:
    g = torch.Generator().manual_seed(41)
    base = torch.linspace(0, 3, 12, dtype=torch.float64)
    return torch.exp(-((base - 3 * torch.rand(20, 1, generator=g, dtype=torch.float64)) ** 2))


def vq_losses(fixed: bool):
    def losses(vq: SpectrumVQ, x: torch.Tensor) -> dict[str, torch.Tensor]:
        z, e, recon = vq(x)
        if fixed:  # noqa: SIM108 (the ROOT line stays alone)
            codebook = (e - z.detach()).pow(2).mean()  # STOP vq-codebook-term-detached
        else:
            codebook = (e.detach() - z.detach()).pow(2).mean()  # ROOT vq-codebook-term-detached
        commit = (z - e.detach()).pow(2).mean()  # STOP vq-codebook-term-detached
        return {"recon": (recon - x).pow(2).mean(), "codebook": codebook, "commit": 0.25 * commit}

    return losses


@case(CASE, family="vector_quantised", mechanism="detach of a whole term beside intended detaches",
      expect={"graph-break-in-model"})  # fmt: skip
def build(fixed: bool):
    return grown(13, SpectrumVQ), vq_losses(fixed), spectra(), {}


@truth(CASE)
def check(fixed: bool) -> None:
    vq, step, batch, _ = build(fixed)
    params = params_of(vq)
    trained = {k for t in ("recon", "codebook", "commit") for k, g in autograd_of(step(vq, batch)[t], params).items()
               if reached(g)}  # fmt: skip
    assert ("codebook" in trained) == fixed  # nothing trains the codebook in the bug
    # The codebook term moves with the codebook either way: the bug only loses its gradient.
    assert moves(lambda: step(vq, batch)["codebook"], params["codebook"]) > 1e-9
