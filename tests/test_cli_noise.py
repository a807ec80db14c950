"""Quiet means quiet: what torch says during a probe is counted in the report, not printed (quiet.py).

Dynamo's warnings stay off stderr and out of pytest's captured log; torch's structured trace logger adds
no empty ``DEBUG torch.__trace`` lines to a failing test's log; ``-v`` lets everything through.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings

import pytest
import torch

import gradprobe

FAILING_TEST = """
import torch
import gradprobe


def step(model, x):
    return {"fit": model(x).pow(2).mean(), "reg": model.weight.pow(2).sum()}


def test_fails():
    torch.manual_seed(0)
    fm = gradprobe.probe(torch.nn.Linear(3, 1), step, torch.randn(4, 3), variants="eager,compile:eager")
    assert fm.exit_code == 1  # it is 0: the test fails, and pytest shows its captured log
"""


def test_a_failing_test_s_captured_log_has_no_torch_trace_lines(pytester):
    # pytest attaches its capture handler to every non-propagating logger, torch.__trace among them;
    # torch then logs each structured-trace event to it, an empty DEBUG line each (170 on a real model).
    # In a subprocess: an in-process run drops the modules it imported, torch's compilers among them,
    # which cannot be imported twice in one process.
    pytester.makepyfile(test_user=FAILING_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert "assert 0 == 1" in text
    assert "torch.__trace" not in text, [line for line in result.outlines if "torch.__trace" in line][:3]


def _torch_handlers() -> list[tuple[str, logging.Handler, list]]:
    loggers = [logging.getLogger()] + [
        log
        for name, log in logging.Logger.manager.loggerDict.items()
        if name.startswith("torch") and isinstance(log, logging.Logger)
    ]
    return [(log.name, h, list(h.filters)) for log in loggers for h in log.handlers]


def _chatty_step(model, x):
    # What dynamo does while compiling (a log record on its logger, a Python warning), in eager so that
    # every run says it; and the user's own logging, which is theirs to see.
    logging.getLogger("torch._dynamo").warning("Graph break from `Tensor.item()`, consider setting ...")
    warnings.warn("TypedStorage is deprecated", UserWarning, stacklevel=1)
    logging.getLogger("my_trainer").warning("epoch 0 started")
    return {"fit": model(x).pow(2).mean(), "reg": model.weight.pow(2).sum()}


def test_torch_s_warnings_during_a_probe_are_counted_in_the_flow_map_not_logged(caplog, recwarn):
    trace = logging.getLogger("torch.__trace")
    handlers, trace_handlers = _torch_handlers(), list(trace.handlers)
    with caplog.at_level(logging.DEBUG):
        fm = gradprobe.probe(torch.nn.Linear(3, 1), _chatty_step, torch.randn(4, 3), progress=False)
    assert [r.name for r in caplog.records] == ["my_trainer"] * len(caplog.records) != []
    assert not recwarn.list  # nor in pytest's warnings summary
    (said,) = [w for w in fm.warnings if "during the probe" in w]
    assert said.split(" warning(s)")[0].isdigit() and "kept off the terminal" in said
    assert "(first: torch._dynamo WARNING: Graph break from `Tensor.item()`, consider setting ...)" in said
    # The logging configuration is as it was: no filter left on a handler, the trace logger's handlers back.
    assert _torch_handlers() == handlers and trace.handlers == trace_handlers


def test_shown_lets_them_through(caplog):
    from gradprobe.quiet import shown

    with caplog.at_level(logging.WARNING), shown(), pytest.warns(UserWarning, match="TypedStorage"):
        fm = gradprobe.probe(torch.nn.Linear(3, 1), _chatty_step, torch.randn(4, 3), progress=False)
    assert "torch._dynamo" in {r.name for r in caplog.records}
    assert not [w for w in fm.warnings if "during the probe" in w]


NOISY_SPEC = """
import torch
import gradprobe


def step(model, x):
    energy = model(x).sum()
    scale = energy.detach().abs().item()  # dynamo breaks the graph here, and warns about it
    return {"energy": energy.pow(2) / (1 + scale), "reg": model.weight.pow(2).sum()}


def spec():
    torch.manual_seed(0)
    return gradprobe.ProbeSpec(model=torch.nn.Linear(3, 1), step=step, batch=torch.randn(4, 3))
"""


def _run(path, *options):  # type: ignore[no-untyped-def]
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS", "TORCH_TRACE")}
    return subprocess.run(
        [sys.executable, "-m", "gradprobe", "run", str(path), "--variants", "eager,compile:eager", *options],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )


@pytest.mark.slow
def test_quiet_means_quiet_on_the_command_line_and_v_shows_torch_s_warnings(tmp_path):
    # A fresh process each: dynamo says this graph break once per process.
    path = tmp_path / "noisy.py"
    path.write_text(NOISY_SPEC)
    quiet = _run(path, "--quiet")
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr
    assert quiet.stderr == ""  # 17 lines of dynamo's warning before
    assert "during the probe, kept off the terminal (first: torch._dynamo" in quiet.stdout
    assert "Graph break from `Tensor.item()`" in quiet.stdout
    verbose = _run(path, "--quiet", "-v")  # -v after the command
    assert verbose.returncode == 0, verbose.stdout + verbose.stderr
    assert "Graph break from `Tensor.item()`" in verbose.stderr
    assert "kept off the terminal" not in verbose.stdout
