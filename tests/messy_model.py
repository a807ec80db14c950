"""The model the state tests probe: everything a probe could leave changed."""

from __future__ import annotations

import torch
from torch import nn


class Messy(nn.Module):
    """BatchNorm (running statistics change in train mode), dropout (draws from the RNG), a frozen
    layer, and a submodule in eval mode while the rest trains."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 8)
        self.norm = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head_a = nn.Linear(8, 1)
        self.head_b = nn.Linear(8, 1)
        self.head_b.eval()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.frozen(self.drop(self.norm(torch.tanh(self.inp(x)))))
        return self.head_a(h), self.head_b(h)
