"""A synthetic wide model for the benchmark: many small parameter tensors plus a few big ones.

``WideModel(n_branches, width, n_big, big_dim)``: ``n_branches`` small ``Linear(width, width)``
layers in parallel (2 parameter tensors each) and ``n_big`` big ``Linear(big_dim, big_dim)`` layers.
Three loss terms, each using an overlapping half of the branches and one big layer:

* ``a``: branches ``[0, n/2)`` and big layer 0
* ``b``: branches ``[n/4, 3n/4)`` and big layer 1
* ``c``: branches ``[n/2, n)`` and big layer 2

so every term reaches a different subset of the parameters and every parameter is reached by at
least one term. The full-size benchmark model (2,048 branches of width 16, three 4,096-wide big
layers) has 4,102 parameter tensors and 50.9 M float32 scalars.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

TERMS = ("a", "b", "c")


class WideModel(nn.Module):
    def __init__(self, n_branches: int, width: int, n_big: int = 0, big_dim: int = 0) -> None:
        super().__init__()
        if n_branches < 4:
            raise ValueError("need at least 4 branches (each term uses half of them)")
        self.branches = nn.ModuleList(nn.Linear(width, width) for _ in range(n_branches))
        self.big = nn.ModuleList(nn.Linear(big_dim, big_dim) for _ in range(n_big))

    def term_branches(self, k: int) -> range:
        n = len(self.branches)
        lo = k * n // 4
        return range(lo, lo + n // 2)

    def forward(self, x: Tensor, x_big: Tensor | None = None) -> dict[str, Tensor]:
        ys = [torch.tanh(branch(x)) for branch in self.branches]
        out = {}
        for k, name in enumerate(TERMS):
            r = self.term_branches(k)
            value = torch.stack(ys[r.start : r.stop]).sum(0).pow(2).mean()
            if x_big is not None:
                for j in range(k, len(self.big), len(TERMS)):
                    value = value + self.big[j](x_big).pow(2).mean()
            out[name] = value
        return out


def wide_step(model: WideModel, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """Terms-mode step: the three terms."""
    return model(batch["x"], batch.get("x_big"))


def make_wide(
    n_branches: int, width: int, n_big: int = 0, big_dim: int = 0, batch_size: int = 8, seed: int = 0
) -> tuple[WideModel, dict[str, Tensor]]:
    """A deterministic WideModel (float32, CPU) and a batch for it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = WideModel(n_branches, width, n_big, big_dim)
        batch = {"x": torch.randn(batch_size, width)}
        if n_big:
            batch["x_big"] = torch.randn(batch_size, big_dim)
    return model, batch


def size_of(model: nn.Module) -> tuple[int, int]:
    """(parameter tensors, scalars) of the trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    return len(params), sum(p.numel() for p in params)
