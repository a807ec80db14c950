"""PyTorch Lightning: a callback that probes the module's own ``training_step`` inside ``Trainer.fit``.

    from gradprobe.adapters.lightning import GradProbeCallback
    trainer = L.Trainer(callbacks=[GradProbeCallback(variants="eager,compile:aot_eager")])
    trainer.fit(module, datamodule)     # the probe runs on the first training batch, before its step

The terms are what ``training_step`` *returns*: a dict whose scalar tensors other than ``"loss"`` are
the terms (or those named in ``terms=``); a step that returns only a loss is probed as one term.
Values passed to ``self.log`` cannot serve: Lightning detaches them (unless ``enable_graph=True``), and
the probe mutes ``self.log`` / ``self.log_dict`` while it calls the step so nothing it computes lands
in the run's metrics. The probe itself runs on the batch Lightning is about to train on, and leaves the
module exactly as found (parameters, ``.grad``, modes, buffers, RNG); the report is written as
``gradprobe.html``, ``gradprobe.md`` and ``gradprobe.flow.json`` under ``report_dir`` (default: the
trainer's log directory). With ``fail_on_error=True`` an error-severity finding stops the run with
``GradProbeFailedError``. ``variants`` adds gradprobe's own traced/compiled forms of the same step, compared
value by value with eager: the way to compare a module with its compiled form.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import GradProbeError, StepContractError
from ..flowmap import FlowMap

try:  # the unified package first, then the standalone one
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        from pytorch_lightning.callbacks import Callback
    except ImportError as e:
        raise ImportError(
            "the Lightning adapter needs PyTorch Lightning: pip install 'gradprobe[lightning]'"
        ) from e


class GradProbeFailedError(GradProbeError):
    """Raised from the callback when the probe found an error-severity problem and ``fail_on_error``."""


def step_terms(out: Any, terms: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """The loss terms in what ``training_step`` returned (see the module docstring)."""
    if isinstance(out, torch.Tensor):
        if terms is not None and list(terms) != ["loss"]:
            raise StepContractError(
                f"training_step returned a single tensor, but terms {list(terms)} were asked for: "
                "return a dict with one entry per term"
            )
        return {"loss": out}
    if not isinstance(out, Mapping):
        raise StepContractError(
            f"training_step returned {type(out).__name__}; the probe needs the loss or a dict of terms"
        )
    if terms is not None:
        missing = [t for t in terms if t not in out]
        if missing:
            raise StepContractError(
                f"training_step's dict has no {missing[0]!r}; it has: {', '.join(map(str, out))}"
            )
        return {t: out[t] for t in terms}
    found = {
        str(k): v
        for k, v in out.items()
        if k != "loss" and isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point()
    }
    if found:
        return found
    if isinstance(out.get("loss"), torch.Tensor):
        return {"loss": out["loss"]}
    raise StepContractError("training_step's dict holds neither a 'loss' nor scalar term tensors")


@contextlib.contextmanager
def _muted_logging(module: torch.nn.Module) -> Iterator[None]:
    """``self.log`` and ``self.log_dict`` do nothing while the probe calls the step."""
    saved = {name: module.__dict__.get(name) for name in ("log", "log_dict")}

    def mute(*args: Any, **kwargs: Any) -> None:
        del args, kwargs

    module.__dict__["log"] = mute
    module.__dict__["log_dict"] = mute
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = value


def probe_lightning_module(
    module: torch.nn.Module,
    batch: Any,
    batch_idx: int = 0,
    *,
    terms: Sequence[str] | None = None,
    variants: str | Sequence[str] = "eager",
    diagnose: bool = False,
    checks: Sequence[str] = (),
    progress: bool = True,
    **spec_fields: Any,
) -> FlowMap:
    """Probe ``module.training_step(batch, batch_idx)`` term by term (see the module docstring)."""
    from ..probe import probe

    chosen = list(terms) if terms is not None else None

    def step(model: torch.nn.Module, b: Any) -> dict[str, torch.Tensor]:
        return step_terms(model.training_step(b, batch_idx), chosen)

    with _muted_logging(module):
        return probe(
            module,
            step,
            batch,
            terms=chosen,
            mode="terms",
            variants=variants,
            diagnose=diagnose,
            checks=checks,
            progress=progress,
            name=spec_fields.pop("name", type(module).__name__),
            **spec_fields,
        )


class GradProbeCallback(Callback):
    """Run gradprobe once, on the training batch of global step ``at_step``, before that step trains.

    Args:
        at_step: the global step whose batch is probed (0: the first).
        terms: the term names in ``training_step``'s returned dict (default: see the module docstring).
        variants: gradprobe variants of the step to compare, e.g. ``"eager,compile:aot_eager"``.
        diagnose: bisect and locate failures (extra traces and compiles).
        report_dir: where the reports go (default: ``trainer.log_dir``, else ``default_root_dir``).
        fail_on_error: raise ``GradProbeFailedError`` when the probe finds an error-severity problem.
        print_report: print the terminal report (rank 0).
        progress: show the probe's progress on stderr (off by default: Lightning's own bar is there).
    """

    def __init__(
        self,
        *,
        at_step: int = 0,
        terms: Sequence[str] | None = None,
        variants: str | Sequence[str] = "eager",
        diagnose: bool = False,
        report_dir: str | os.PathLike[str] | None = None,
        fail_on_error: bool = False,
        print_report: bool = True,
        progress: bool = False,
    ) -> None:
        super().__init__()
        self.at_step = at_step
        self.terms = terms
        self.variants = variants
        self.diagnose = diagnose
        self.report_dir = report_dir
        self.fail_on_error = fail_on_error
        self.print_report = print_report
        self.progress = progress
        self.flow_map: FlowMap | None = None
        self.report_paths: dict[str, Path] = {}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.flow_map is not None or trainer.global_step != self.at_step:
            return
        fm = probe_lightning_module(
            pl_module,
            batch,
            batch_idx,
            terms=self.terms,
            variants=self.variants,
            diagnose=self.diagnose,
            progress=self.progress and getattr(trainer, "is_global_zero", True),
        )
        self.flow_map = fm
        if getattr(trainer, "is_global_zero", True):
            self.report_paths = self._write(fm, trainer)
            if self.print_report:
                from ..report.terminal import render

                print(render(fm))
        if self.fail_on_error and fm.errors():
            first = fm.errors()[0]
            raise GradProbeFailedError(
                f"gradprobe found {len(fm.errors())} error(s) in {type(pl_module).__name__}.training_step: "
                f"{first.cause}: {first.message}"
                + (f" (report: {self.report_paths['html']})" if self.report_paths else "")
            )

    def _write(self, fm: FlowMap, trainer: Any) -> dict[str, Path]:
        from ..report.html import render_html
        from ..report.markdown import render_markdown

        base = self.report_dir or getattr(trainer, "log_dir", None) or trainer.default_root_dir
        out = Path(base)
        out.mkdir(parents=True, exist_ok=True)
        paths = {
            "html": out / "gradprobe.html",
            "markdown": out / "gradprobe.md",
            "json": out / "gradprobe.flow.json",
        }
        paths["html"].write_text(render_html(fm), encoding="utf-8")
        paths["markdown"].write_text(render_markdown(fm), encoding="utf-8")
        fm.to_json(paths["json"])
        return paths


__all__ = ["GradProbeCallback", "GradProbeFailedError", "probe_lightning_module", "step_terms"]
