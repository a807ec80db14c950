"""A small multi-task model: a shared body, two task heads and a weight-decay regulariser.

For the researcher whose auxiliary loss "does nothing": terms ``task_a``, ``task_b``, ``l2``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..spec import ProbeSpec


class TwoHeads(nn.Module):
    def __init__(self, n_in: int = 4, hidden: int = 8) -> None:
        super().__init__()
        self.body = nn.Linear(n_in, hidden)
        self.head_a = nn.Linear(hidden, 1)
        self.head_b = nn.Linear(hidden, 1)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = torch.tanh(self.body(x))
        return self.head_a(h), self.head_b(h)


def multitask_terms(model: TwoHeads, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
    a, b = model(batch["x"])
    return {
        "task_a": (a - batch["ya"]).pow(2).mean(),
        "task_b": (b - batch["yb"]).pow(2).mean(),
        "l2": 1e-3 * sum(p.pow(2).sum() for p in model.parameters()),
    }


def multitask_weights_step(
    model: TwoHeads, batch: Mapping[str, Tensor], weights: Mapping[str, Tensor]
) -> Any:
    terms = multitask_terms(model, batch)
    total = (
        weights["task_a"] * terms["task_a"]
        + weights["task_b"] * terms["task_b"]
        + weights["l2"] * terms["l2"]
    )
    return total, terms


def flag_step(model: TwoHeads, batch: Mapping[str, Tensor], weights: Mapping[str, Tensor]) -> Any:
    """BUG (recompile-per-scenario): the weights become Python flags, like DeePMD's ``find_force``;
    a compiled step is specialised (guarded) on every flag, so it recompiles per scenario."""
    find_a, find_b, find_l2 = bool(weights["task_a"]), bool(weights["task_b"]), bool(weights["l2"])
    terms = multitask_terms(model, batch)
    total = terms["task_a"] * 0.0
    if find_a:
        total = total + terms["task_a"]
    if find_b:
        total = total + terms["task_b"]
    if find_l2:
        total = total + terms["l2"]
    return total, terms


def make_multitask_batch(n: int = 16, seed: int = 0, dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu") -> dict[str, Tensor]:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g, dtype=torch.float64)
    batch = {"x": x, "ya": x.sum(-1, keepdim=True).sin(), "yb": x[:, :1].cos()}
    return {k: v.to(device=device, dtype=dtype) for k, v in batch.items()}


def multitask_spec(*, flags: bool = False, dtype: torch.dtype = torch.float32, device: str = "cpu",
                   variants: str | None = None, seed: int = 0) -> ProbeSpec:  # fmt: skip
    """A weights-mode spec for TwoHeads; ``flags=True`` injects the recompile-per-scenario bug."""

    def factory() -> TwoHeads:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return TwoHeads().to(device=device, dtype=dtype)

    return ProbeSpec(
        model=factory,
        step=flag_step if flags else multitask_weights_step,
        batch=make_multitask_batch(seed=seed, dtype=dtype, device=device),
        second_batch=make_multitask_batch(seed=seed + 1, dtype=dtype, device=device),
        terms=["task_a", "task_b", "l2"],
        mode="weights",
        variants=variants,
        seed=seed,
        name="two-head multi-task model",
    )
