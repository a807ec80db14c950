"""SimSiam on augmented views of tabular sensor windows: an encoder, a projector and a predictor; the
loss is the negative cosine between the predictor's output for one view and the projection of the
other view, with a stop-gradient on the projection (the target branch), symmetrised.

Intended: no error; a ``stop-gradient`` warning, if any, at a ``# STOP`` line.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as nnf

from . import autograd_of, case, grown, moves, params_of, reached, truth

CASE = "simsiam-target-branch"


class SimSiam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 16))
        self.projector = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.GELU(), nn.Linear(16, 8))
        self.predictor = nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8))


def views_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    window = torch.randn(24, 12, generator=g, dtype=torch.float64)
    jitter = lambda: 0.1 * torch.randn(24, 12, generator=g, dtype=torch.float64)  # noqa: E731
    scale = 1 + 0.2 * torch.rand(24, 1, generator=g, dtype=torch.float64)
    return {"view_one": window + jitter(), "view_two": scale * window + jitter()}


def simsiam_step(net: SimSiam, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    z1 = net.projector(net.encoder(batch["view_one"]))
    z2 = net.projector(net.encoder(batch["view_two"]))
    p1, p2 = net.predictor(z1), net.predictor(z2)
    target1 = z1.detach()  # STOP simsiam-target-branch
    target2 = z2.detach()  # STOP simsiam-target-branch
    agreement = -0.5 * (nnf.cosine_similarity(p1, target2).mean() + nnf.cosine_similarity(p2, target1).mean())
    return {"agreement": agreement}


@case(CASE, family="siamese", mechanism="detach (target branch)", intended=True)
def build(fixed: bool):
    return grown(7, SimSiam), simsiam_step, views_batch(), {}


@truth(CASE)
def check(fixed: bool) -> None:
    net, step, batch, _ = build(fixed)
    params = params_of(net)
    grads = autograd_of(step(net, batch)["agreement"], params)
    assert all(reached(g) for g in grads.values())  # the online branch reaches everything
    # The cut exists: the value depends on the target branch, whose gradient is dropped. Compare with
    # the same loss without the stop-gradient.
    z1 = net.projector(net.encoder(batch["view_one"]))
    z2 = net.projector(net.encoder(batch["view_two"]))
    full = -0.5 * (
        nnf.cosine_similarity(net.predictor(z1), z2).mean()
        + nnf.cosine_similarity(net.predictor(z2), z1).mean()
    )
    torch.testing.assert_close(full, step(net, batch)["agreement"])
    undetached = autograd_of(full, params)
    w = "encoder.0.weight"
    assert not torch.allclose(grads[w], undetached[w])  # type: ignore[arg-type]
    assert moves(lambda: step(net, batch)["agreement"], params[w]) > 1e-9
