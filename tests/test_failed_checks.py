"""A failed check is an error finding and exit 1: the verdict never contradicts the checks section.

Physics, training and consistency failures each become a finding, a check that cannot run too, and a
NaN is a failure, never a pass.
"""

from __future__ import annotations

import dataclasses
import textwrap
import threading

import pytest
import torch
from torch import nn

import gradprobe
from gradprobe.cli import main
from gradprobe.diagnose import diagnose
from gradprobe.report.html import render_html
from gradprobe.report.markdown import render_markdown
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
    def broken_energy(m, b):  # type: ignore[no-untyped-def]
        raise TypeError("this energy cannot be evaluated")

    spec = dataclasses.replace(_spring_spec(Springs()), energy_fn=broken_energy)
    fm = gradprobe.probe(spec, checks=["physics"])
    assert fm.checks["physics"]["passed"] is False and "TypeError" in fm.checks["physics"]["error"]
    (finding,) = [f for f in fm.findings if f.cause == "check-could-not-run"]
    assert finding.severity == "error" and "physics" in finding.message
    assert fm.count("eager", "e only") == (1, 1)  # the measurement itself stands
    assert fm.exit_code == 1


def test_a_check_that_needs_a_missing_package_says_install_it():
    """The check's import failed (deepmd.pt's e3nn in CI): the fix names the module, not the step."""

    def energy_needing_a_package(m, b):  # type: ignore[no-untyped-def]
        import gradprobe_no_such_package.sub  # noqa: F401

    spec = dataclasses.replace(_spring_spec(Springs()), energy_fn=energy_needing_a_package)
    fm = gradprobe.probe(spec, checks=["physics"])
    (finding,) = [f for f in fm.findings if f.cause == "check-could-not-run"]
    assert "imports `gradprobe_no_such_package`" in finding.fix
    assert "install the package that provides `gradprobe_no_such_package`" in finding.fix
    assert "the step's own" not in finding.fix and fm.exit_code == 1


@pytest.mark.parametrize("check", ["physics", "training", "balance"])
def test_every_check_on_a_model_that_cannot_be_copied_runs_on_the_model_itself(check):
    """Issue 33: a model that cannot be deep-copied is checked on itself, its state put back after;
    the attribute that refuses the copy is named in the check's result."""
    model = Springs()
    model.lock = threading.Lock()  # type: ignore[attr-defined]  # deepcopy raises TypeError on it
    spec = _spring_spec(model)
    if check == "balance":
        # Adam or SGD are stepped one tensor copy at a time, without a model copy; ASGD needs one.
        spec = dataclasses.replace(spec, optimizer=lambda params: torch.optim.ASGD(params, lr=0.01))
    k = model.k.detach().clone()
    fm = gradprobe.probe(spec, checks=[check])
    assert not [f for f in fm.findings if f.severity == "error"], [f.message for f in fm.findings]
    result = fm.checks[check]
    part = result["effective_update"] if check == "balance" else result
    why = part["why"] if check != "physics" else part["precision"]["why"]
    assert "'lock'" in why and "cannot be deep-copied" in why  # names the attribute
    assert (part["on"] if check != "physics" else part["precision"]["on"]) == "the model itself"
    if check == "training":
        assert result["verdicts"]["eager"] == {"e": "decreases"}
    if check == "physics":
        assert result["passed"] and result["precision"]["dtype"] == "float64"
    assert fm.count("eager", "e only") == (1, 1) and fm.exit_code == 0
    assert torch.equal(model.k, k) and model.k.grad is None and model.lock.acquire(blocking=False)
    for render in (gradprobe.render, render_markdown, render_html):
        text = render(fm)
        if check != "balance" and render is gradprobe.render:  # the report says where it ran, and why
            assert "the model itself" in text and "'lock'" in text
    back = gradprobe.FlowMap.from_json(fm.to_json())
    assert [f.cause for f in diagnose(back)] == [f.cause for f in fm.findings]


class Cached(nn.Module):
    """Keeps its last output: a tensor that is not a graph leaf, which deepcopy refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = self.lin(x)
        return self.last


@pytest.mark.parametrize("kind", ["cached activation", "old-style spectral_norm"])
def test_checks_copy_a_model_holding_computed_tensors(kind):
    torch.manual_seed(0)
    x = torch.randn(8, 3)
    if kind == "cached activation":
        model: nn.Module = Cached()
    else:
        model = nn.Sequential(torch.nn.utils.spectral_norm(nn.Linear(3, 4)), nn.Tanh(), nn.Linear(4, 1))
    model(x)  # after a forward, the model holds tensors with a grad_fn
    held = [v for m in model.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]
    assert any(not v.is_leaf for v in held)

    def step(m, b):  # type: ignore[no-untyped-def]
        return {"fit": m(b).pow(2).mean(), "reg": sum(p.pow(2).sum() for p in m.parameters())}

    fm = gradprobe.probe(model, step, x, checks=["training", "balance"])
    assert not [f for f in fm.findings if f.cause == "check-could-not-run"], [f.message for f in fm.findings]
    assert fm.checks["training"]["verdicts"]["eager"] == {"fit": "decreases", "reg": "decreases"}
    assert set(fm.checks["balance"]["effective_update"]["terms"]) == {"fit", "reg"}
    after = [v for m in model.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]
    assert len(after) == len(held) and all(a is b for a, b in zip(after, held, strict=True))


def test_a_step_that_raises_on_a_later_call_in_the_balance_check_is_recorded():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    model[2].bias.requires_grad_(False)  # a frozen parameter: the balance check runs the step again
    calls = []

    def step(m, b):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("the data loader is exhausted")
        return {"fit": m(b).pow(2).mean(), "reg": m[0].weight.pow(2).sum()}

    fm = gradprobe.probe(model, step, torch.randn(8, 3), checks=["balance"])
    assert len(calls) == 2
    found = [f for f in fm.findings if f.cause == "check-could-not-run"]
    assert len(found) == 1 and "exhausted" in found[0].message and "balance" in found[0].message
    assert fm.checks["balance"]["shares"]["fit"]  # the rest of the balance check stands
    assert model[2].bias.requires_grad is False
    assert "could not run" in gradprobe.render(fm)


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
