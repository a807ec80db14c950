"""A failed check is an error finding and exit 1: the verdict never contradicts the checks section.

Physics, training and consistency failures each become a finding, a check that cannot run too, and a
NaN is a failure, never a pass.
"""

from __future__ import annotations

import textwrap
import threading

import torch
from torch import nn

import gradprobe
from gradprobe.cli import main
from gradprobe.variants import user_variant


def _errors(fm: gradprobe.FlowMap) -> list[str]:
    return sorted(f.cause for f in fm.findings if f.severity == "error")


class Springs(nn.Module):
    """Pair energy of atoms on springs of learned stiffness; ``broken`` makes the energy NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.k = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))
        self.broken = False

    def energy(self, pos: torch.Tensor) -> torch.Tensor:
        d = (pos[:, :, None, :] - pos[:, None, :, :]).pow(2).sum(-1)
        e = 0.5 * self.k * d.sum((1, 2))
        return e * torch.nan if self.broken else e


def _spring_spec(model: Springs) -> gradprobe.ProbeSpec:
    pos = torch.randn(2, 4, 3, dtype=torch.float64)

    def predict(m, b):  # type: ignore[no-untyped-def]
        x = b["pos"].clone().requires_grad_(True)
        return {"force": -torch.autograd.grad(m.energy(x).sum(), x, create_graph=True)[0]}

    def step(m, b):  # type: ignore[no-untyped-def]
        return {"e": m.energy(b["pos"]).mean()}

    return gradprobe.ProbeSpec(
        model=model,
        step=step,
        batch={"pos": pos},
        energy_fn=lambda m, b: m.energy(b["pos"]),
        predict=predict,
        coord_key="pos",
        box_key=None,
    )


def test_a_nan_physics_check_fails_and_is_an_error():
    model = Springs()
    fm = gradprobe.probe(_spring_spec(model), checks=["physics"])
    assert fm.checks["physics"]["passed"] and fm.exit_code == 0
    model.broken = True
    fm = gradprobe.probe(_spring_spec(model), checks=["physics"])
    physics = fm.checks["physics"]
    assert not physics["passed"] and physics["force"]["max_rel_error"] != physics["force"]["max_rel_error"]
    assert "forces-not-conservative" in _errors(fm) and fm.exit_code == 1


def test_a_check_that_cannot_run_is_an_error_and_the_rest_stands():
    model = Springs()
    model.lock = threading.Lock()  # type: ignore[attr-defined]  # deepcopy raises TypeError on it
    fm = gradprobe.probe(_spring_spec(model), checks=["training"])
    assert fm.checks["training"]["passed"] is False and "TypeError" in fm.checks["training"]["error"]
    (finding,) = [f for f in fm.findings if f.cause == "check-could-not-run"]
    assert finding.severity == "error" and "training" in finding.message
    assert fm.count("eager", "e only") == (1, 1)  # the measurement itself stands
    assert fm.exit_code == 1


def test_a_term_that_does_not_decrease_is_an_error():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x = torch.randn(16, 3)

    def step(m, b):  # type: ignore[no-untyped-def]
        y = m(b)
        # "grow" rises when the weights shrink it: trained, it goes up, not down.
        return {"fit": y.pow(2).mean(), "grow": -m.weight.pow(2).sum()}

    fm = gradprobe.probe(model, step, x, checks=["training"])
    assert fm.checks["training"]["verdicts"]["eager"] == {"fit": "decreases", "grow": "decreases"}
    assert fm.exit_code == 0

    def flat(m, b):  # type: ignore[no-untyped-def]
        return {"fit": m(b).pow(2).mean(), "const": (m.weight * 0).sum() + 1.0}

    fm = gradprobe.probe(model, flat, x, checks=["training"])
    assert fm.checks["training"]["verdicts"]["eager"]["const"] == "flat"  # exact zero gradients
    (finding,) = [f for f in fm.findings if f.cause == "term-not-decreasing"]
    assert finding.location == {"variant": "eager", "terms": ["const"]} and "1 → 1" in finding.message
    assert fm.exit_code == 1


def test_a_consistency_failure_below_the_table_tolerance_is_an_error():
    # Values 1e-8 off: within the table's rtol (1e-7, float64), beyond allclose at 1e-10.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    x = torch.randn(8, 3, dtype=torch.float64)

    def step(m, b):  # type: ignore[no-untyped-def]
        return {"fit": m(b).pow(2).mean()}

    def builder(ctx):  # type: ignore[no-untyped-def]
        def run(b, w):  # type: ignore[no-untyped-def]
            fit = ctx.model(b).pow(2).mean() * (1 + 3e-8)
            return w["fit"] * fit, {"fit": fit}

        return run

    fm = gradprobe.probe(model, step, x, variants=["eager", user_variant("close", builder)])
    assert not fm.differences("close", "fit only")  # the table sees no difference
    assert not fm.checks["consistency"]["variants"]["close"]["passed"]
    assert _errors(fm) == ["consistency-failed"] and fm.exit_code == 1


SPEC = """
import torch
import gradprobe


def spec():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)

    def step(m, b):
        return {"fit": m(b).pow(2).mean(), "stuck": (m.weight * 0).sum() + 1.0}

    return gradprobe.ProbeSpec(model=model, step=step, batch=torch.randn(8, 3))
"""


def test_cli_exits_1_when_a_check_fails(tmp_path, capsys):
    path = tmp_path / "flat.py"
    path.write_text(textwrap.dedent(SPEC))
    assert main(["run", str(path), "--check", "training"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("gradprobe: PROBLEM") and "ERROR term-not-decreasing" in out
