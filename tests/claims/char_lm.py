"""A character-level language model with tied input and output embeddings: each position mixes the
embeddings of the two previous characters, and the logits are the mixed state against the embedding
table. Terms: next-character cross-entropy and a z-loss on the log-partition function.

Bug: the output projection reads ``self.table.weight.data``. The table still gets a gradient through
the input lookup, so it is reached, but the gradient lacks the whole output-projection part (rows of
characters absent from the batch get exactly zero).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as nnf

from . import autograd_of, case, fd_vs_autograd, grown, params_of, reached, truth, worst_disagreement

CASE = "lm-tied-table-data"
VOCAB, WIDTH, CONTEXT = 23, 16, 2


class TiedCharLM(nn.Module):
    def __init__(self, tie_by_value: bool) -> None:
        super().__init__()
        self.tie_by_value = tie_by_value
        self.table = nn.Embedding(VOCAB, WIDTH)
        self.mixer = nn.Linear(CONTEXT * WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.logit_bias = nn.Parameter(torch.zeros(VOCAB))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.table(ids)  # (B, T, W)
        window = torch.cat([e[:, :-1], e[:, 1:]], dim=-1)  # the two previous characters
        h = self.norm(torch.tanh(self.mixer(window)))
        if self.tie_by_value:  # noqa: SIM108 (the ROOT line stays alone)
            out_weight = self.table.weight.data  # ROOT lm-tied-table-data
        else:
            out_weight = self.table.weight
        return nnf.linear(h, out_weight, self.logit_bias)


def char_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    # A corpus that uses only part of the vocabulary (as a real batch does).
    return {"ids": torch.randint(0, VOCAB - 6, (4, 10), generator=g)}


def lm_step(model: TiedCharLM, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    ids = batch["ids"]
    logits = model(ids)[:, :-1]
    target = ids[:, CONTEXT:]
    xent = nnf.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
    z_loss = 1e-2 * torch.logsumexp(logits, dim=-1).pow(2).mean()
    return {"xent": xent, "z_loss": z_loss}


@case(
    CASE,
    family="char_lm",
    mechanism=".data weight tying",
    expect={"gradient-mismatch", "graph-break-in-model"},
)
def build(fixed: bool):
    return grown(2, lambda: TiedCharLM(tie_by_value=not fixed)), lm_step, char_batch(), {}


@truth(CASE)
def check(fixed: bool) -> None:
    model, step, batch, _ = build(fixed)
    params = params_of(model)
    grads = autograd_of(step(model, batch)["xent"], params)
    assert all(reached(g) for g in grads.values()), "every parameter tensor is reached, bug or not"
    unseen = grads["table.weight"][VOCAB - 6 :]  # type: ignore[index]
    off = worst_disagreement(fd_vs_autograd(lambda: step(model, batch)["xent"], params))
    if fixed:
        assert off < 1e-6 and bool(unseen.abs().sum() > 0), off
    else:
        assert off > 0.1 and bool(unseen.abs().sum() == 0), off
