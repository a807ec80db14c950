"""Progress on stderr during long work: which variant, which stage, how long it has run.

A compiled probe, a check or a bisection can run for minutes with nothing to show; a newcomer thinks it
hung. While a probe runs, a ``stage(...)`` context names what is being done ("make_fx+compile:inductor ›
scenario 2/4 force only"); a reporter thread (one per process, never woken by a probe: it looks for
one every ``GRACE`` seconds, and sleeps without wake-ups after a minute without any) writes it
to stderr:

* on a terminal (and not under CI): one live line (``rich``), redrawn with the elapsed time, gone at the end;
* otherwise (a pipe, a log file, CI): plain timestamped lines, one when a stage has settled and a
  "still ..." line when nothing was written for ``HEARTBEAT`` seconds, so a log never goes quiet longer.

Work that ends within ``GRACE`` seconds prints nothing: a quick probe in a script or a notebook stays
silent. Stages are entered by the probe's own code; nothing here touches the user's model or step. The
reporter is per context (a ``ContextVar``): a nested probe (a check probing a copy) reports inside the
outer one's line instead of starting its own.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any, TextIO

GRACE = 1.0  # seconds of silence before anything is shown: quick probes print nothing
SETTLE = 0.5  # a stage is written (plain lines) once it has lasted this long: no flood of short stages
HEARTBEAT = 4.0  # plain lines: at most this long without a line while work goes on
TICK = 0.2  # how often the reporter thread looks
QUIET = 60.0  # seconds without a probe after which the reporter thread stops looking for one

_SILENT = object()  # the reporter of a block with progress turned off
_current: ContextVar[Any] = ContextVar("gradprobe_progress", default=None)


def live_capable(stream: Any) -> bool:
    """A live (redrawn) line only on an interactive terminal, never under CI or a dumb terminal."""
    if os.environ.get("CI") or os.environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


@contextlib.contextmanager
def reporting(enabled: bool = True, stream: TextIO | None = None, live: bool | None = None) -> Iterator[None]:
    """Report the stages entered inside on ``stream`` (default stderr) while the block runs.

    ``live=None`` picks a live line on a terminal and plain lines otherwise. Inside another
    ``reporting`` block this does nothing: the outer reporter shows the inner stages (or, when the
    outer block is disabled, nothing does).
    """
    if _current.get() is not None:
        yield
        return
    if not enabled:
        # Silence holds for what runs inside too: a probe called by a quiet command stays quiet.
        token = _current.set(_SILENT)
        try:
            yield
        finally:
            _current.reset(token)
        return
    out = stream if stream is not None else sys.stderr
    reporter = _Reporter(out, live)  # live=None: decided by the ticker when it first shows something
    token = _current.set(reporter)
    reporter.start()
    try:
        yield
    finally:
        _current.reset(token)
        reporter.stop()


@contextlib.contextmanager
def stage(text: str) -> Iterator[None]:
    """Name what the block does while it runs (nested stages are shown joined: outer › inner)."""
    reporter = _current.get()
    if not isinstance(reporter, _Reporter):
        yield
        return
    reporter.push(text)
    try:
        yield
    finally:
        reporter.pop()


def active() -> bool:
    """Whether stages entered now are shown."""
    return isinstance(_current.get(), _Reporter)


class _Ticker:
    """The one thread that ticks every active reporter, started at the first probe that reports and
    kept between probes: starting and joining a thread per probe cost about 0.6 ms, a tenth of a small
    model's probe.

    A probe does not wake it: a woken thread takes the GIL from the probe at once (two thread
    switches, about 70 us of a small model's probe measured warm), and nothing is shown before
    ``GRACE`` anyway. Between probes it looks for a new reporter every ``GRACE`` seconds (so a probe
    is shown by ``2 * GRACE + TICK`` at the latest); after ``QUIET`` seconds without a probe it waits
    without a timeout (no wake-ups at all), and the next probe wakes it."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.reporters: list[_Reporter] = []
        self.thread: threading.Thread | None = None
        self.asleep = False  # waiting without a timeout: a new reporter must wake it

    def add(self, reporter: _Reporter) -> None:
        with self.cond:
            self.reporters.append(reporter)
            if self.thread is None or not self.thread.is_alive():  # first use
                self.thread = threading.Thread(target=self._loop, name="gradprobe-progress", daemon=True)
                self.thread.start()
            elif self.asleep:
                self.cond.notify()

    def remove(self, reporter: _Reporter) -> None:
        with self.cond, contextlib.suppress(ValueError):
            self.reporters.remove(reporter)

    def _loop(self) -> None:
        last_seen = time.monotonic()
        while True:
            with self.cond:
                while not self.reporters:
                    if time.monotonic() - last_seen > QUIET:
                        self.asleep = True
                        self.cond.wait()  # long idle: no wake-ups until the next probe
                        self.asleep = False
                    else:
                        self.cond.wait(timeout=GRACE)
                active = list(self.reporters)
            for reporter in active:
                reporter.tick()
            last_seen = time.monotonic()
            time.sleep(TICK)


_TICKER = _Ticker()


def _new_ticker_after_fork() -> None:
    # A forked child has no ticker thread, and its condition may have been held by it at the fork.
    global _TICKER
    _TICKER = _Ticker()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_ticker_after_fork)


class _Reporter:
    """The stage stack of one probe, written out by the shared ticker thread."""

    def __init__(self, stream: TextIO, live: bool | None) -> None:
        self.stream = stream
        self.live = live  # None: not decided yet (a terminal check, a syscall: off the probe's path)
        self.lock = threading.Lock()
        self.stack: list[tuple[str, float]] = []  # (text, entered at)
        self.started = time.perf_counter()
        self.last_line = 0.0  # when a plain line was last written (perf_counter)
        self.last_written: tuple[str, ...] = ()
        self.wrote = False
        self.done = False
        self.broken = False  # a tick raised: stop showing, keep probing
        self._live: Any = None

    # -- the probe's side ----------------------------------------------------------------------------
    def start(self) -> None:
        _TICKER.add(self)

    def push(self, text: str) -> None:
        with self.lock:
            self.stack.append((text, time.perf_counter()))

    def pop(self) -> None:
        with self.lock:
            if self.stack:
                self.stack.pop()

    def stop(self) -> None:
        _TICKER.remove(self)
        with self.lock:  # a tick in progress ends first; none follows (done)
            self.done = True
            if self._live is not None:
                with contextlib.suppress(Exception):
                    self._live.stop()
                self._live = None
            elif self.wrote:
                self._write(f"done in {_seconds(time.perf_counter() - self.started)}")

    # -- the ticker's side ---------------------------------------------------------------------------
    def tick(self) -> None:
        with self.lock:
            if self.done or self.broken:
                return
            try:
                self._tick(time.perf_counter())
            except Exception:  # progress must never break a probe: stop showing, keep probing
                self.broken = True

    def _tick(self, now: float) -> None:
        if now - self.started < GRACE or not self.stack:
            return
        if self.live is None:
            self.live = live_capable(self.stream)
        path = tuple(t for t, _ in self.stack)
        entered = self.stack[-1][1]
        if self.live:
            self._show_live(" › ".join(path), now - entered, now - self.started)
            return
        # A new stage is written once it has lasted SETTLE (short stages would flood a log), the first
        # one at once when the grace period ends.
        if path != self.last_written and (now - entered >= SETTLE or not self.wrote):
            self._write(" › ".join(path))
            self.last_written = path
        elif now - self.last_line >= HEARTBEAT:
            self._write(f"{' › '.join(path)} (still running, {self._lasted(now)})")

    def _lasted(self, now: float) -> str:
        """How long the innermost stage that has lasted a while has run: a stage just entered (one of
        many short ones, a bisection's trials) would say "0.0 s in this stage"."""
        lasting = [(text, entered) for text, entered in self.stack if now - entered >= GRACE]
        if not lasting:
            return f"{_seconds(now - self.started)} in all"
        text, entered = lasting[-1]
        where = "this stage" if len(lasting) == len(self.stack) else text
        return f"{_seconds(now - entered)} in {where}"

    def _write(self, text: str) -> None:
        elapsed = time.perf_counter() - self.started
        with contextlib.suppress(Exception):  # a closed or broken stream: the probe goes on
            self.stream.write(f"gradprobe [{elapsed:6.1f} s] {text}\n")
            self.stream.flush()
        self.last_line = time.perf_counter()
        self.wrote = True

    def _show_live(self, text: str, in_stage: float, total: float) -> None:
        from rich.text import Text

        line = Text.assemble(
            ("gradprobe ", "bold"),
            (text, "cyan"),
            (f"  {_seconds(in_stage)} · {_seconds(total)} in all", "dim"),
        )
        if self._live is None:
            from rich.console import Console
            from rich.live import Live
            from rich.spinner import Spinner

            self._spinner = Spinner("dots", text=line)
            console = Console(file=self.stream, force_terminal=True)
            # transient: the line is gone when the probe ends, leaving only the report; what the user's
            # step prints meanwhile is written above it (rich's redirection, undone at the end).
            self._live = Live(self._spinner, console=console, transient=True, refresh_per_second=8)
            self._live.start()
        else:
            self._spinner.update(text=line)


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 60 else f"{int(s // 60)} min {s % 60:04.1f} s"
