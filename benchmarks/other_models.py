"""Models for the benchmark written unlike ``wide_model.py``: what users bring, not what we built.

``wide_model.py`` is parallel ``nn.Linear`` branches with a few big layers, its terms slices of one
stack. Its big layers dominate the time and hide both a fixed per-probe overhead and per-tensor
Python cost. The models here expose them:

* ``SmallNet``: ten parameter tensors in a functional style (a convolution, a layer norm and two
  heads called through ``torch.nn.functional``, two raw ``nn.Parameter`` s), three terms of different
  kinds (a reconstruction MSE, a cross entropy, a parameter regulariser). Its step is about a
  millisecond: any fixed overhead of the probe shows.
* ``make_mlp``: ten tensors as an ``nn.Sequential`` of Linear, BatchNorm1d (six buffers updated in
  training mode), ReLU and Dropout (the step draws random numbers): the cheapest step here, about
  1.1 ms warm for one forward and four backward passes.
* ``TinyEncoder``: an embedding, one ``nn.TransformerEncoderLayer`` (attention, dropout, layer norms)
  and a head, fifteen tensors; two terms (a language-model cross entropy and a logit penalty).
* ``ManyBlocks``: a ``ModuleList`` of tiny blocks (a gain and an offset vector, a ``Linear(4, 4)``:
  four tensors each) applied in sequence with the outputs collected, stacked and summed per term.
  512 / 2,048 / 8,192 parameter tensors at a few scalars each: the time is per-tensor work.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as fn

SMALL_TERMS = ("recon", "cls", "reg")
MLP_TERMS = ("fit", "l1", "decay")
ENCODER_TERMS = ("lm", "z")
BLOCK_TERMS = ("early", "late", "smooth")


class SmallNet(nn.Module):
    """Conv1d -> layer norm -> two heads; a learned temperature and a gate as bare parameters."""

    def __init__(self, channels: int = 6, length: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.conv_w = nn.Parameter(torch.randn(channels, 1, 3) * 0.3)
        self.conv_b = nn.Parameter(torch.zeros(channels))
        self.ln_w = nn.Parameter(torch.ones(channels * length))
        self.ln_b = nn.Parameter(torch.zeros(channels * length))
        self.dec_w = nn.Parameter(torch.randn(length, channels * length) * 0.05)
        self.dec_b = nn.Parameter(torch.zeros(length))
        self.cls_w = nn.Parameter(torch.randn(classes, channels * length) * 0.05)
        self.cls_b = nn.Parameter(torch.zeros(classes))
        self.temperature = nn.Parameter(torch.tensor(1.5))
        self.gate = nn.Parameter(torch.full((channels,), 0.5))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = fn.conv1d(x.unsqueeze(1), self.conv_w, self.conv_b, padding=1)
        h = fn.gelu(h) * torch.sigmoid(self.gate)[None, :, None]
        h = fn.layer_norm(h.flatten(1), self.ln_w.shape, self.ln_w, self.ln_b)
        return fn.linear(h, self.dec_w, self.dec_b), fn.linear(h, self.cls_w, self.cls_b) / self.temperature


def small_step(model: SmallNet, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    recon, logits = model(batch["x"])
    return {
        "recon": fn.mse_loss(recon, batch["x"]),
        "cls": fn.cross_entropy(logits, batch["y"]),
        # A regulariser on two parameters only: it reaches 2 of the 10 tensors.
        "reg": 1e-3 * (model.conv_w.square().sum() + (model.temperature - 1).square()),
    }


def make_small(batch_size: int = 32, seed: int = 0) -> tuple[SmallNet, dict[str, Tensor]]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = SmallNet()
        batch = {"x": torch.randn(batch_size, 16), "y": torch.randint(0, 5, (batch_size,))}
    return model, batch


class Block(nn.Module):
    """y = x + tanh(linear(gain * x + offset)): four parameter tensors."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(dim))
        self.offset = nn.Parameter(torch.zeros(dim))
        self.proj = nn.Linear(dim, dim)
        nn.init.normal_(self.proj.weight, std=0.2)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.tanh(self.proj(self.gain * x + self.offset))


class ManyBlocks(nn.Module):
    """``n_blocks`` tiny blocks in sequence; every block's output is kept.

    Terms: ``early`` reads the first half of the outputs, ``late`` the last one (which depends on
    every block before it), ``smooth`` the differences between consecutive outputs of the second
    half. Every term reaches a different set of blocks.
    """

    def __init__(self, n_blocks: int, dim: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_blocks))

    def forward(self, x: Tensor) -> Tensor:
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        return torch.stack(outs)  # (blocks, batch, dim)


def blocks_step(model: ManyBlocks, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    outs = model(batch["x"])
    half = outs.shape[0] // 2
    return {
        "early": outs[:half].square().mean(),
        "late": (outs[-1] - batch["target"]).square().mean(),
        "smooth": (outs[half + 1 :] - outs[half:-1]).abs().sum(0).mean(),
    }


def make_blocks(n_tensors: int, dim: int = 4, batch_size: int = 4, seed: int = 0) -> tuple[ManyBlocks, dict]:
    """A ``ManyBlocks`` with ``n_tensors`` parameter tensors (four per block)."""
    if n_tensors % 4 or n_tensors < 16:
        raise ValueError("n_tensors must be a multiple of 4, at least 16")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ManyBlocks(n_tensors // 4, dim)
        batch = {"x": torch.randn(batch_size, dim), "target": torch.randn(batch_size, dim)}
    return model, batch


def make_mlp(batch_size: int = 16, seed: int = 0) -> tuple[nn.Sequential, dict[str, Tensor]]:
    """Linear -> BatchNorm1d -> ReLU -> Dropout -> Linear -> BatchNorm1d -> ReLU -> Linear, training mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(
            nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.1),
            nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3),
        )  # fmt: skip
        batch = {"x": torch.randn(batch_size, 8), "y": torch.randn(batch_size, 3)}
    return model, batch


def mlp_step(model: nn.Sequential, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    out = model(batch["x"])
    first = model[0]
    return {
        "fit": fn.mse_loss(out, batch["y"]),
        "l1": out.abs().mean(),
        # Weight decay on the first layer only: it reaches 2 of the 10 tensors.
        "decay": first.weight.square().sum() + first.bias.square().sum(),
    }


class TinyEncoder(nn.Module):
    """Token embedding -> one transformer encoder layer (batch first, dropout 0.1) -> vocabulary head."""

    def __init__(self, vocab: int = 20, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layer = nn.TransformerEncoderLayer(dim, 2, 2 * dim, dropout=0.1, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.layer(self.embed(tokens)))


def encoder_step(model: TinyEncoder, tokens: Tensor) -> dict[str, Tensor]:
    logits = model(tokens)
    return {
        "lm": fn.cross_entropy(logits.flatten(0, 1), tokens.flatten()),
        "z": logits.logsumexp(-1).square().mean(),  # a z-loss on the logits' normaliser
    }


def make_encoder(seed: int = 0) -> tuple[TinyEncoder, Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyEncoder()
        tokens = torch.randint(0, 20, (4, 7))
    return model, tokens
