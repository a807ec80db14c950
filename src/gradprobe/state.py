"""Leave the user's world exactly as found: the model (``model_state.py``) and process-wide state
(``process_state.py``), when the step raises and when Ctrl-C arrives (a ``KeyboardInterrupt`` is
re-raised, never recorded, and never lost; it cannot interrupt a restore half way).

Probes run one at a time per process (``_PROBE_LOCK``): each reseeds and restores process-wide state,
which two at once would interleave. A child process forked while a probe runs gets a fresh lock.
"""

from __future__ import annotations

import gc
import importlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .model_state import restore_model, snapshot_model
from .process_state import CONFIG_MODULES, restore_globals, save_globals
from .process_state import contained as contained

# ----- the guarantee ----------------------------------------------------------------------------------

_PROBE_LOCK = threading.RLock()


def _fresh_lock_in_child() -> None:
    # A fork while another thread holds the lock would leave it held forever in the child.
    global _PROBE_LOCK
    _PROBE_LOCK = threading.RLock()


os.register_at_fork(after_in_child=_fresh_lock_in_child)


class _Interrupts:
    """Ctrl-C while a probe runs. In the body it raises ``KeyboardInterrupt`` as Python's own handler
    does; while state is saved or restored (``deferred``) it is only recorded, so it cannot leave the
    user's objects half restored. On exit a recorded interrupt that did not end up propagating (held
    back, or swallowed by code that caught it) is raised: an interrupt is never lost. Signal handlers
    belong to the main thread: in another thread this does nothing."""

    def __init__(self) -> None:
        self.received = False
        self.deferring = False
        self.previous: Any = None

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = True
        if not self.deferring:
            raise KeyboardInterrupt

    @contextmanager
    def deferred(self) -> Iterator[None]:
        deferring, self.deferring = self.deferring, True
        try:
            yield
        finally:
            self.deferring = deferring

    def __enter__(self) -> _Interrupts:
        # A process that ignores SIGINT (started by nohup, a background job of a script) keeps ignoring it.
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) != signal.SIG_IGN
        ):
            try:
                self.previous = signal.signal(signal.SIGINT, self._handle)
            except (ValueError, OSError):  # not the main interpreter
                self.previous = None
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if self.previous is None:
            return
        signal.signal(signal.SIGINT, self.previous)
        if self.received and not (kind is not None and issubclass(kind, KeyboardInterrupt)):
            signal.raise_signal(signal.SIGINT)  # to the user's handler again (Python's: KeyboardInterrupt)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off while gradprobe's own bookkeeping allocates (a snapshot of
    thousands of modules): the allocations would set off collections that traverse the whole heap,
    measured at two thirds of a snapshot's time at 4,000 modules. Never around the user's code."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextmanager
def preserved(
    model: torch.nn.Module,
    params: list[torch.nn.Parameter] | None = None,
    modules: list[torch.nn.Module] | None = None,
    contained: bool = False,
) -> Iterator[None]:
    """Run the body, then put the model and every registered piece of process-wide state back as they
    were. Probes in several threads run one at a time. ``params``, ``modules``: the model's, when the
    caller has listed them already. ``contained``: the caller runs inside ``contained()``, which
    isolates the config modules."""
    with _PROBE_LOCK, _Interrupts() as interrupts:
        with interrupts.deferred(), _gc_paused():
            model_state = snapshot_model(model, params, modules)
            saved = save_globals(contained)
        try:
            yield
        finally:
            # Each part is restored even if another fails. A failure to restore is raised after all
            # ran, unless the body is already raising (its exception, a KeyboardInterrupt say, goes on).
            with interrupts.deferred(), _gc_paused():
                errors = restore_globals(saved)
                try:
                    restore_model(model_state)
                except Exception as e:
                    errors.append(e)
            if errors and sys.exc_info()[1] is None:
                raise errors[0]


@contextmanager
def isolated_settings(import_configs: bool = False) -> Iterator[None]:
    """The global settings and compiler configs as they were before the body, put back after it: what
    one variant's build or run changes does not leak into the next variant, the checks or the
    bisector. ``import_configs`` imports the compiler config modules first, so that a path which is
    about to compile is covered."""
    if import_configs:
        for name in CONFIG_MODULES:
            importlib.import_module(name)
    with _Interrupts() as interrupts:
        with interrupts.deferred():
            saved = save_globals()
        try:
            yield
        finally:
            with interrupts.deferred():
                errors = restore_globals(saved)
            if errors and sys.exc_info()[1] is None:
                raise errors[0]
