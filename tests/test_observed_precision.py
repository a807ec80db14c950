"""A path that computes in bfloat16 (autocast in the user's trainer or in the step) is compared at
bfloat16's tolerance, seen with no cooperation from the path: one run with compiled code off under a
dispatch mode that counts low-precision results (``gradprobe.evidence.precision``). Before, a correct
AMP trainer was an error ("flow-mismatch ... cause not known", gradients 0.8% off: bfloat16 rounding),
and a step with autocast inside got ``makefx-detach`` and ``backend-drops-grads`` errors.
"""

from __future__ import annotations

import torch
from torch import nn

import gradprobe
from gradprobe.claims import audit
from gradprobe.variants import user_variant


class Denoiser(nn.Module):
    """A 1-D convolutional denoiser with a smoothness head: a model of another style than the zoo's."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv1d(2, 8, 5, padding=2), nn.GELU(), nn.Conv1d(8, 8, 5, padding=2), nn.GELU()
        )
        self.out = nn.Conv1d(8, 2, 1)
        self.rough = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.conv(x)
        return self.out(h), self.rough(h.mean(-1)).squeeze(-1)


def losses(m: Denoiser, b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    clean, rough = m(b["noisy"])
    return {
        "denoise": (clean.float() - b["clean"]).pow(2).mean(),
        "rough": (rough.float() - b["tv"]).pow(2).mean(),
    }


def signals() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    clean = torch.sin(torch.linspace(0, 6, 32)).expand(6, 2, 32) * torch.rand(6, 2, 1, generator=g)
    return {"noisy": clean + 0.1 * torch.randn(6, 2, 32, generator=g), "clean": clean,
            "tv": clean.diff(dim=-1).abs().sum((1, 2))}  # fmt: skip


def amp_trainer(detach_rough: bool = False):  # type: ignore[no-untyped-def]
    """The user's own training path: bfloat16 autocast around the step."""

    def builder(ctx):  # type: ignore[no-untyped-def]
        def run(batch, weights):  # type: ignore[no-untyped-def]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                terms = ctx.step(ctx.model, batch)
            if detach_rough:
                terms = {**terms, "rough": terms["rough"].detach().requires_grad_()}
            return sum(weights[t] * terms[t] for t in terms), terms

        return run

    return builder


def _probe(variants, step=losses):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return gradprobe.probe(Denoiser(), step, signals(), terms=["denoise", "rough"], variants=variants,
                           diagnose=True, progress=False)  # fmt: skip


def test_an_amp_trainer_is_compared_at_bfloat16s_tolerance() -> None:
    fm = _probe(["eager", user_variant("amp_trainer", amp_trainer())])
    assert not fm.errors(), gradprobe.render(fm)
    seen = fm.evidence["precision"]["amp_trainer"]
    assert seen["dtype"] == "bfloat16" and "aten.convolution" in seen["ops"], seen
    assert "eager" not in fm.evidence["precision"]  # the reference computes in float32
    worst = max(c.rel_error or 0.0 for c in fm.cells if c.variant == "amp_trainer")
    assert 1e-3 < worst < 5e-2, worst  # rounding a float32 tolerance would call wrong
    entry = fm.checks["consistency"]["variants"]["amp_trainer"]
    assert entry["passed"] and entry["rtol"] == 2e-2
    (warning,) = [w for w in fm.warnings if "computes in bfloat16" in w]
    assert "it is compared with eager at bfloat16's tolerance (relative L1 0.05)" in warning
    assert "at <= 0.02)" in gradprobe.render(fm)


def test_a_real_cut_in_an_amp_trainer_is_still_an_error() -> None:
    fm = _probe(["eager", user_variant("amp_trainer", amp_trainer(detach_rough=True))])
    causes = {f.cause for f in fm.errors()}
    assert "graph-break-in-model" in causes, gradprobe.render(fm)
    assert audit(fm) == []


def test_a_step_with_autocast_inside_is_compared_at_bfloat16s_tolerance_on_every_path() -> None:
    def amp_losses(m, b):  # type: ignore[no-untyped-def]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return losses(m, b)

    fm = _probe("eager,make_fx,compile:aot_eager", amp_losses)
    assert not fm.errors(), gradprobe.render(fm)
    assert set(fm.evidence["precision"]) == {"eager"}
    assert any(
        "eager computes in bfloat16" in w and "every path is compared with it" in w for w in fm.warnings
    )


def test_nothing_is_observed_at_the_parameters_precision_or_for_a_lone_path() -> None:
    assert "precision" not in _probe("eager,make_fx").evidence
    assert "precision" not in _probe(["eager"]).evidence
    assert not [w for w in _probe("eager,make_fx").warnings if "computes in" in w]
