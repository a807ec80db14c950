"""Issue 32's false statements that came from fixed wording, each on a model written here: the words of a
run error or a report line may state only what was measured.

(The others — advice refuted by trials, "verified" over the user's own cut, recompiles explained by
Python numbers, deep-copy advice for a failed run, consistency passing beside wrong cells, guessed
reasons for exact zeros — are in ``test_claims_regressions.py`` and ``test_claims_audit``'s suite-wide
audit; intended stop-gradients that must not be errors are cases of ``tests/claims``.)"""

from __future__ import annotations

import torch
from torch import nn

import gradprobe
from gradprobe.report.markdown import render_markdown
from gradprobe.zoo import reference_spec


def test_a_term_without_gradient_in_a_training_model_is_not_blamed_on_eval_mode() -> None:
    # False statement 1: "Is the model in eval mode?" on a model in train mode. The run error says what
    # was measured (the term has no grad_fn), and nothing asks about a mode nobody recorded.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).train()

    def step(m: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
        y = m(x)
        return {"fit": y.pow(2).mean(), "logged": y.pow(2).mean().detach()}

    fm = gradprobe.probe(model, step, torch.randn(8, 3), diagnose=True, progress=False)
    error = fm.run("eager", "logged only").error
    assert error is not None and error.type == "NoGradPath"
    assert (
        error.message
        == "term 'logged' does not require grad (no grad_fn): no parameter can receive its gradient"
    )
    words = gradprobe.render(fm, show_all=True) + render_markdown(fm)
    assert "eval mode" not in words, words


def test_no_report_line_guesses_that_tracing_or_compilation_broke_a_path() -> None:
    # False statement 2: "tracing or compilation breaks some paths" beside a bisection that measured
    # that compilation does not matter. The meaning lines state counts and lost parameters only.
    fm = gradprobe.probe(
        reference_spec(bug="makefx-detach"), variants="eager,make_fx", diagnose=True, progress=False
    )
    words = gradprobe.render(fm, show_all=True) + render_markdown(fm)
    assert "force only, make_fx: reaches 8 vs 10 in eager; lost: " in words
    assert "tracing or compilation" not in words and "eval mode?" not in words
