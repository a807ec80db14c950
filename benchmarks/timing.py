"""Interleaved timing on a shared, noisy machine: A B C A B C ..., the minimum of each.

The minimum estimates the undisturbed run time (noise only ever adds); interleaving spreads slow
phases of the machine over all contenders instead of one. ``time.perf_counter`` only.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Mapping
from typing import Any


def interleaved(
    fns: Mapping[str, Callable[[], Any]],
    reps: int,
    before: Callable[[], None] | None = None,
    warm: bool = False,
) -> dict[str, list[float]]:
    """Seconds per call of each function, ``reps`` rounds. ``before`` runs untimed before each call.
    ``warm``: each timed call right after an untimed call of the same function, with no
    ``gc.collect()`` between (its code and data as warm as they get); else after ``gc.collect()``."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            if before is not None:
                before()
            if warm:
                fn()
                if before is not None:
                    before()
            else:
                gc.collect()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def best(times: Mapping[str, list[float]]) -> dict[str, float]:
    return {k: min(v) for k, v in times.items()}
