"""Probe a LightningModule's own ``training_step`` inside ``Trainer.fit``, with a callback.

    pip install 'gradprobe[lightning]'
    python examples/lightning_probe.py              # reports the unused head, training goes on
    python examples/lightning_probe.py --strict     # fail_on_error: a broken term stops the run

The module returns its terms from ``training_step`` (``self.log`` detaches what it logs, so logged
values cannot serve); the callback probes the first batch before it trains, compares eager with
``torch.compile(aot_eager)`` of the same step, and writes gradprobe.html / .md / .flow.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import lightning.pytorch as pl
import torch

from gradprobe.adapters.lightning import GradProbeCallback, GradProbeFailedError


class Regressor(pl.LightningModule):
    def __init__(self, broken: bool = False) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(4, 16)
        self.head = torch.nn.Linear(16, 1)
        self.uncertainty_head = torch.nn.Linear(16, 1)  # built, then forgotten: never used
        self.broken = broken

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        h = torch.tanh(self.trunk(x))
        fit = (self.head(h) - y).pow(2).mean()
        smooth = h.pow(2).mean()
        if self.broken:
            smooth = torch.sqrt(smooth - smooth)  # d sqrt(0): an infinite gradient
        self.log("fit", fit)
        return {"loss": fit + 0.01 * smooth, "fit": fit, "smooth": smooth}

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strict", action="store_true", help="a broken term and fail_on_error=True")
    args = parser.parse_args(argv)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16
    )
    root = tempfile.mkdtemp(prefix="gradprobe-lightning-")
    callback = GradProbeCallback(
        variants="eager,compile:aot_eager", fail_on_error=args.strict, report_dir=root
    )
    trainer = pl.Trainer(max_steps=5, accelerator="cpu", default_root_dir=root, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, callbacks=[callback])  # fmt: skip
    try:
        trainer.fit(Regressor(broken=args.strict), loader)
    except GradProbeFailedError as e:
        print(f"run stopped: {e}")
        return 1
    print(f"trained {trainer.global_step} steps; report: {callback.report_paths['html']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
