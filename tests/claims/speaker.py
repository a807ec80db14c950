"""Speaker embeddings from frames of filterbank features: a frame network, mean pooling, an
embedding; a speaker classifier (cross-entropy) and a centre loss that pulls each embedding towards
its speaker's centre. The centres are a moving average: the stored centres (a buffer) moved towards
this batch's per-speaker means, written row by row into a preallocated table through ``.detach()``
(they act as targets, as in the centre-loss method; the stored centres are updated outside the step).

Intended, through a buffer write: no error; a ``stop-gradient`` warning, if any, at the ``# STOP`` line.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as nnf

from . import autograd_of, case, grown, moves, params_of, reached, truth

CASE = "speaker-centre-table"
SPEAKERS, FRAMES, BANDS, EMBED = 4, 10, 8, 6
MOMENTUM = 0.5


class SpeakerNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frame_net = nn.Sequential(nn.Linear(BANDS, 16), nn.Softsign(), nn.Linear(16, 16))
        self.embed = nn.Linear(16, EMBED)
        self.classify = nn.Linear(EMBED, SPEAKERS)
        self.register_buffer("stored_centres", torch.zeros(SPEAKERS, EMBED))

    def forward(self, fbank: torch.Tensor) -> torch.Tensor:
        return self.embed(self.frame_net(fbank).mean(dim=1))


def _speaker_net() -> SpeakerNet:
    net = SpeakerNet()
    with torch.no_grad():
        net.stored_centres.normal_()  # as after some steps of training
    return net


def utterances() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(16)
    who = torch.arange(24) % SPEAKERS
    voice = torch.randn(SPEAKERS, BANDS, generator=g, dtype=torch.float64)
    fbank = voice[who][:, None, :] + 0.3 * torch.randn(24, FRAMES, BANDS, generator=g, dtype=torch.float64)
    return {"fbank": fbank, "speaker": who}


def speaker_step(net: SpeakerNet, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    emb = net(batch["fbank"])
    who = batch["speaker"]
    centres = emb.new_zeros(SPEAKERS, EMBED)
    for s in range(SPEAKERS):
        moved = MOMENTUM * net.stored_centres[s] + (1 - MOMENTUM) * emb[who == s].mean(dim=0)
        centres[s] = moved.detach()  # STOP speaker-centre-table
    return {
        "speaker_ce": nnf.cross_entropy(net.classify(emb), who),
        "centre": ((emb - centres[who]) ** 2).sum(dim=1).mean(),
    }


@case(CASE, family="speaker", mechanism="detach into a preallocated table", intended=True)
def build(fixed: bool):
    return grown(17, _speaker_net), speaker_step, utterances(), {}


@truth(CASE)
def check(fixed: bool) -> None:
    net, step, batch, _ = build(fixed)
    params = params_of(net)
    grads = autograd_of(step(net, batch)["centre"], params)
    assert reached(grads["embed.weight"]) and reached(grads["frame_net.0.weight"])
    # The cut exists: with the centres left attached, the centre loss's gradient is different.
    emb = net(batch["fbank"])
    means = torch.stack([emb[batch["speaker"] == s].mean(dim=0) for s in range(SPEAKERS)])
    centres = MOMENTUM * net.stored_centres + (1 - MOMENTUM) * means
    attached = ((emb - centres[batch["speaker"]]) ** 2).sum(dim=1).mean()
    torch.testing.assert_close(attached, step(net, batch)["centre"])
    full = autograd_of(attached, params)
    assert not torch.allclose(full["embed.weight"], grads["embed.weight"])  # type: ignore[arg-type]
    assert moves(lambda: step(net, batch)["centre"], params["embed.weight"]) > 1e-9
