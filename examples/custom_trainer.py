"""Probe a hand-written trainer through gradprobe's trainer protocol: a dozen lines of glue.

    python examples/custom_trainer.py            # the trainer as written: compiled matches plain
    python examples/custom_trainer.py --bug      # its compiled path detaches the trunk for the aux term

The trainer below is the kind people write: one model, per-term weights, and an option to compile
its loss function. The adapter (``TinyTrainerAdapter``) tells gradprobe how to get a batch, how to
run the trainer's own loss with per-term weights, and which configurations (plain, compiled) exist
and with which knobs, so the bisector can flip them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from gradprobe import render
from gradprobe.trainer import probe_trainer


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(4, 16)
        self.head = torch.nn.Linear(16, 1)
        self.aux = torch.nn.Linear(16, 2)

    def forward(
        self, x: torch.Tensor, detach_trunk_for_aux: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.trunk(x))
        return self.head(h), self.aux(h.detach() if detach_trunk_for_aux else h)


class TinyTrainer:
    """A trainer someone wrote: it weighs its loss terms and can compile its loss function."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = Net()
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(64, 4, generator=g)
        self.y = self.x.sum(1, keepdim=True)
        self.labels = (self.x[:, :2] > 0).float()

    def next_batch(self) -> dict[str, torch.Tensor]:
        return {"x": self.x[:16], "y": self.y[:16], "labels": self.labels[:16]}

    def compute_loss(
        self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor], term_weights: Mapping[str, Any],
        detach_trunk_for_aux: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        pred, logits = model(batch["x"], detach_trunk_for_aux)
        fit = (pred - batch["y"]).pow(2).mean()
        aux = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch["labels"])
        return term_weights["fit"] * fit + term_weights["aux"] * aux

    def compiled_loss(self, backend: str = "aot_eager", buggy: bool = False) -> Any:
        def loss(model: torch.nn.Module, batch: Any, weights: Mapping[str, Any]) -> torch.Tensor:
            return self.compute_loss(model, batch, weights, detach_trunk_for_aux=buggy)

        return torch.compile(loss, backend=backend)


class TinyTrainerAdapter:
    """The glue: gradprobe's trainer protocol (see gradprobe.trainer) for TinyTrainer."""

    name = "tiny"
    terms = ("fit", "aux")
    configurations: ClassVar[dict[str, Any]] = {
        "plain": {},
        "compiled": {"detach_aux": (False, (False, True)), "backend": ("aot_eager", ("aot_eager", "eager"))},
    }

    def __init__(self, trainer: TinyTrainer) -> None:
        self.trainer = trainer

    def module(self) -> torch.nn.Module:
        return self.trainer.model

    def batch(self) -> Any:
        return self.trainer.next_batch()

    def loss(self, model: torch.nn.Module, batch: Any, weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.trainer.compute_loss(model, batch, weights)

    def build(self, configuration: str, knobs: Mapping[str, Any], model: torch.nn.Module) -> Any:
        # `model` is the module to build on: the trainer's own, or the copy a training check steps.
        step = self.trainer.compiled_loss(knobs.get("backend", "aot_eager"), knobs.get("detach_aux", False))
        return lambda batch, weights: step(model, batch, weights)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bug", action="store_true", help="the compiled path detaches the trunk for aux")
    args = parser.parse_args(argv)
    adapter = TinyTrainerAdapter(TinyTrainer())
    fm = probe_trainer(
        adapter, knobs={"compiled": {"detach_aux": True}} if args.bug else None, diagnose=args.bug
    )
    print(render(fm))
    return fm.exit_code


if __name__ == "__main__":
    sys.exit(main())
