"""Issue 32, "Say only what was measured": regression tests for the false statements of the value, flow
and check causes, on models written here.

* One tolerance story: a consistency PASS beside cells the table calls wrong (matgl: an absolute 1e-6
  hid 4% errors on gradients of 3e-5).
* unused-parameter guessed "a zero-initialised gate or a ReLU mask" for exact zeros that come from a
  class absent from the batch.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradprobe
from gradprobe.claims import audit
from gradprobe.variants import user_variant


# ----- one tolerance story --------------------------------------------------------------------------


class SmallGradient(nn.Module):
    """A fit whose ``small`` parameter gets gradients of about 2e-5 per element (float32)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 8)
        self.small = nn.Parameter(torch.full((8,), 0.01))

    def fit(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return 0.01 * self.body(x).pow(2).mean() + 2e-5 * scale * (x @ self.small).mean()


def _small_gradient_map(scale: float) -> gradprobe.FlowMap:
    model = SmallGradient()
    x = torch.rand(64, 8, generator=torch.Generator().manual_seed(1)) + 0.5

    def builder(ctx):  # type: ignore[no-untyped-def]
        def run(b, w):  # type: ignore[no-untyped-def]
            fit = ctx.model.fit(b, scale)  # the small parameter's share scaled: its gradient too
            return w["fit"] * fit, {"fit": fit}

        return run

    step = lambda m, b: {"fit": m.fit(b)}  # noqa: E731
    return gradprobe.probe(model, step, x, variants=["eager", user_variant("scaled", builder)], progress=False)


def test_consistency_fails_on_4_percent_errors_of_small_float32_gradients():
    fm = _small_gradient_map(1.04)
    cell = fm.cell("scaled", "fit only", "small")
    assert cell.norm is not None and 1e-5 < cell.norm / 8 < 3e-5  # gradients of ~2e-5
    assert cell.verdict == "wrong" and 0.039 < cell.rel_error < 0.041
    # An absolute 1e-6 per element (the old allclose) passed these cells: the difference is below it.
    ref = fm.cell("eager", "fit only", "small")
    assert cell.rel_error * ref.norm / 8 < 1e-6
    consistency = fm.checks["consistency"]["variants"]["scaled"]
    assert not consistency["passed"], consistency
    (worst,) = consistency["worst"]
    assert worst["parameter"] == "small" and worst["verdict"] == "wrong"
    assert worst["rel_error"] == pytest.approx(cell.rel_error)
    # The check agrees with the cells: every cell the table marks, and only those here.
    table = {(s, p) for s in fm.scenario_names for p in fm.differences("scaled", s)}
    assert {(w["scenario"], w["parameter"]) for w in consistency["worst"]} == table
    (finding,) = [f for f in fm.findings if f.severity == "error"]
    assert finding.cause == "flow-mismatch" and "relative error up to 0.04" in finding.message
    assert not audit(fm)


def test_the_healthy_twin_passes_consistency():
    fm = _small_gradient_map(1.0)
    consistency = fm.checks["consistency"]["variants"]["scaled"]
    assert consistency["passed"] and consistency["checked_cells"] == 3 and consistency["failed_cells"] == 0
    assert not fm.findings
