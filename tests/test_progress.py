"""Progress on stderr: a line within 2 s of a variant starting and at least every 5 s during a long stage.

The CLI runs in a subprocess with stderr piped (not a terminal: plain lines), on a spec whose own
variant's builder sleeps 7 s; each line's arrival time is read as it comes, and the builder writes the
moment it started.
"""

from __future__ import annotations

import io
import itertools
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

import gradprobe
from gradprobe import progress

SLOW_SPEC = """
import time
from pathlib import Path

import torch

from gradprobe import ProbeSpec
from gradprobe.variants import register_variant

STARTED = Path(__file__).with_name("builder_started")


def step(model, batch):
    y = model(batch)
    return {"fit": y.pow(2).mean(), "reg": model.weight.pow(2).sum()}


def slow_builder(ctx):
    STARTED.write_text(repr(time.time()))
    time.sleep(7.0)  # a long compile, as a real trainer's would be

    def run(batch, weights):
        terms = ctx.step(ctx.model, batch)
        return sum(weights[t] * v for t, v in terms.items()), terms

    return run


register_variant("slow_trainer", slow_builder)


def spec():
    torch.manual_seed(0)
    return ProbeSpec(model=torch.nn.Linear(3, 2), step=step, batch=torch.randn(5, 3), terms=["fit", "reg"])
"""


def _run_cli(tmp_path: Path, *extra: str) -> tuple[list[tuple[float, str]], str, int]:
    target = tmp_path / "slow_spec.py"
    target.write_text(SLOW_SPEC)
    env = {k: v for k, v in os.environ.items() if k != "CI"}  # plain lines come from the pipe, not CI
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradprobe", "run", str(target), "--variants", "eager,slow_trainer", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append((time.time(), line.rstrip("\n")))

    reader = threading.Thread(target=read)
    reader.start()
    assert proc.stdout is not None
    out = proc.stdout.read()  # not communicate(): it would read stderr too, under the reader's feet
    proc.wait(timeout=240)
    reader.join()
    return lines, out, proc.returncode


def test_a_slow_builder_is_shown_within_2_s_and_every_5_s(tmp_path: Path) -> None:
    lines, out, code = _run_cli(tmp_path)
    assert code == 0, (out, lines)
    assert "OK" in out.splitlines()[0]
    started = float((tmp_path / "builder_started").read_text())
    during = [(t, text) for t, text in lines if text.startswith("gradprobe [")]
    assert during, f"no progress lines on stderr: {lines}"
    first = next((t for t, text in during if "slow_trainer" in text and t >= started), None)
    assert first is not None, lines
    assert first - started <= 2.0, (
        f"the slow variant was first shown {first - started:.1f} s after it started"
    )
    # While the builder sleeps (7 s) the log never goes quiet for more than 5 s.
    stamps = [started] + [t for t, _ in during if started <= t <= started + 7.0] + [started + 7.0]
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    assert max(gaps) <= 5.0, f"a gap of {max(gaps):.1f} s without progress: {during}"
    assert any("slow_trainer › build" in text for _, text in during), during
    assert any("still running" in text for _, text in during), during
    assert during[-1][1].split("] ", 1)[1].startswith("done in"), during
    # Progress is on stderr only: the report on stdout is the same as without it.
    assert "gradprobe [" not in out


def test_quiet_prints_no_progress(tmp_path: Path) -> None:
    lines, out, code = _run_cli(tmp_path, "--quiet")
    assert code == 0
    assert [text for _, text in lines if text.startswith("gradprobe [")] == []
    assert "OK" in out.splitlines()[0]


def _slow_step(model: torch.nn.Module, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    time.sleep(progress.GRACE + 0.7)  # the eager forward of a big model
    y = model(batch)
    return {"fit": y.pow(2).mean(), "reg": model.weight.pow(2).sum()}


def _stderr_of(monkeypatch, **kwargs) -> str:  # type: ignore[no-untyped-def]
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buf)
    gradprobe.probe(torch.nn.Linear(3, 2), _slow_step, torch.randn(5, 3), **kwargs)
    return buf.getvalue()


def test_the_python_api_reports_and_progress_false_is_silent(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    shown = _stderr_of(monkeypatch)
    assert "gradprobe [" in shown and "eager › one forward, a gradient per term" in shown, shown
    assert _stderr_of(monkeypatch, progress=False) == ""


def test_a_quick_probe_prints_nothing(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buf)
    model = torch.nn.Linear(3, 2)
    gradprobe.probe(model, lambda m, b: {"fit": m(b).sum()}, torch.ones(2, 3))
    assert buf.getvalue() == ""


def test_the_live_line_on_a_terminal_is_gone_at_the_end() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    with progress.reporting(stream=out, live=True), progress.stage("make_fx › build"):
        time.sleep(progress.GRACE + 0.6)
    text = out.getvalue()
    assert "make_fx › build" in text  # drawn while it ran
    assert "\x1b[" in text  # with the terminal's control sequences (redrawn, then erased)
    assert "done in" not in text  # transient: no plain lines left behind


def test_a_nested_reporter_does_not_start_a_second_line() -> None:
    out = io.StringIO()
    with (
        progress.reporting(stream=out, live=False),
        progress.reporting(stream=io.StringIO(), live=False),
        progress.stage("inner"),
    ):
        time.sleep(progress.GRACE + 0.4)
    assert "inner" in out.getvalue()


def test_live_only_on_a_terminal_outside_ci(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    assert progress.live_capable(Terminal())
    assert not progress.live_capable(io.StringIO())
    monkeypatch.setenv("CI", "true")
    assert not progress.live_capable(Terminal())


def test_probes_share_one_reporter_thread() -> None:
    # A thread started and joined per probe cost 0.6 ms (a fifth of a small model's floor): one
    # reporter thread serves every probe of the process and waits, idle, between them.
    model = torch.nn.Linear(3, 1)

    def step(m, b):  # type: ignore[no-untyped-def]
        return {"fit": m(b).square().mean()}

    for _ in range(3):
        gradprobe.probe(model, step, torch.ones(2, 3), progress=True)
    reporters = [t for t in threading.enumerate() if t.name == "gradprobe-progress"]
    assert len(reporters) == 1 and reporters[0].daemon
    assert not progress._TICKER.reporters  # no probe left registered: the thread is idle


def test_the_heartbeat_never_says_zero_seconds_in_a_stage_just_entered() -> None:
    # Many short stages (a bisection's trials): when the heartbeat is due, the stage of the moment has
    # just begun; the line gives the time of the stage around it that has lasted, not "0.0 s".
    out = io.StringIO()
    reporter = progress._Reporter(out, live=False)
    t0 = reporter.started
    reporter.wrote, reporter.last_line = True, t0 + 5.0
    reporter.last_written = ("compile:eager", "trial 36")
    reporter.stack = [("compile:eager", t0 + 1.0), ("trial 37", t0 + 9.99)]
    reporter._tick(t0 + 10.0)
    assert out.getvalue().endswith("compile:eager › trial 37 (still running, 9.0 s in compile:eager)\n")
    reporter.stack = [("compile:eager", t0 + 1.0), ("trial 38", t0 + 15.0)]  # a long one, written
    reporter.last_written = ("compile:eager", "trial 38")
    reporter._tick(t0 + 20.0)
    assert out.getvalue().endswith("compile:eager › trial 38 (still running, 5.0 s in this stage)\n")
    reporter.stack = [("lineage", t0 + 29.9)]
    reporter._tick(t0 + 30.0)
    assert out.getvalue().endswith("lineage (still running, 30.0 s in all)\n")
    assert "running, 0.0 s" not in out.getvalue()
