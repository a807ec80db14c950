"""Quiet means quiet: what torch says while a probe runs goes into the flow map, not onto the terminal.

A probe traces, compiles and replays the user's step many times. Dynamo's and the compilers' warnings
(``warnings.warn``, and records at WARNING or above on the ``torch`` loggers, which torch writes to
stderr itself) would reach the user's terminal once per compile; under pytest, which attaches its
capture handler to every non-propagating logger, torch's structured trace logger ``torch.__trace``
would add an empty DEBUG line per compile event to a failing test's captured log. While a probe runs
the warnings are recorded instead, and the flow map's ``warnings`` says how many and the first.

Nothing of the user's configuration is replaced: the warning filters apply as before (an ignored
warning is not counted, an ``error`` filter still raises), handlers get a filter for the probe's
duration, and the trace logger keeps torch's own handler (``TORCH_TRACE`` still writes its files);
all of it is put back at the end. ``shown()`` (the command's ``-v``) lets everything through.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar

T = TypeVar("T")

_mode: ContextVar[str | None] = ContextVar("gradprobe_quiet", default=None)  # "capturing" or "shown"


@contextlib.contextmanager
def shown() -> Iterator[None]:
    """Probes run inside the block let torch's warnings and logging through, as without gradprobe."""
    token = _mode.set("shown")
    try:
        yield
    finally:
        _mode.reset(token)


def quietly(run: Callable[..., T], *args: Any) -> tuple[T, list[str]]:
    """``run(*args)`` with torch's warnings and logging kept off the terminal: its result, and the line for
    the flow map's ``warnings`` (none when nothing was said, inside ``shown()``, or inside another
    ``quietly``, which records what this one hears)."""
    if _mode.get() is not None:
        return run(*args), []
    token = _mode.set("capturing")
    heard = _Heard()
    try:
        with warnings.catch_warnings(), _torch_logging(heard):
            warnings.showwarning = heard.warned  # what would have been shown: the filters still apply
            result = run(*args)
    finally:
        _mode.reset(token)
    if not heard.said:
        return result, []
    return result, [
        f"{len(heard.said)} warning(s) from torch or the step during the probe, kept off the terminal "
        f"(first: {heard.said[0]}); gradprobe -v shows them"
    ]


def _first_line(message: Any) -> str:
    lines = str(message).strip().splitlines()
    text = lines[0].strip() if lines else ""
    return text if len(text) <= 200 else text[:199] + "…"


def _is_torch(name: str) -> bool:
    return name == "torch" or name.startswith("torch.")


class _Heard(logging.Filter):
    """What was said, in order: the warnings shown (``warned``, as ``warnings.showwarning``) and, on
    every handler that torch's records reach, its records at WARNING and above, which are kept from
    being written (once each, though several handlers see a record); other records pass."""

    def __init__(self) -> None:
        super().__init__()
        self.said: list[str] = []
        self.last: logging.LogRecord | None = None  # a record goes through its handlers one after another

    def warned(self, message: Any, category: type[Warning], *_: Any, **__: Any) -> None:
        self.said.append(f"{category.__name__}: {_first_line(message)}")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or not _is_torch(record.name):
            return True  # the user's own logging, or torch's debug logs they turned on (TORCH_LOGS)
        if record is not self.last:
            self.last = record
            self.said.append(f"{record.name} {record.levelname}: {_first_line(record.getMessage())}")
        return False


@contextlib.contextmanager
def _torch_logging(heard: _Heard) -> Iterator[None]:
    """The filter on the handlers of the root and ``torch`` loggers; the trace logger without the
    handlers that are not torch's (pytest's). Both undone on exit."""
    # Most of the hundred-odd loggers have no handler (and placeholders have none to have): asked
    # first, so the names of only the few with handlers are looked at.
    loggers = [logging.getLogger()] + [
        log
        for log in list(logging.Logger.manager.loggerDict.values())
        if getattr(log, "handlers", None) and isinstance(log, logging.Logger) and _is_torch(log.name)
    ]
    handlers = list({id(h): h for log in loggers for h in log.handlers}.values())
    trace = logging.getLogger("torch.__trace")
    foreign = [h for h in trace.handlers if not _torch_handler(h)]
    for h in handlers:
        h.addFilter(heard)
    for h in foreign:
        trace.removeHandler(h)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(heard)
        for h in foreign:
            if h not in trace.handlers:
                trace.addHandler(h)


def _torch_handler(handler: logging.Handler) -> bool:
    """A handler torch's logging set up (TORCH_LOGS, TORCH_TRACE), not one added by someone else."""
    try:
        from torch._logging._internal import _is_torch_handler
    except ImportError:  # another torch: keep every handler (the trace lines may show, nothing breaks)
        return True
    return bool(_is_torch_handler(handler))
