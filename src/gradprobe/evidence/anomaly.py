"""The user's line of a failure raised inside autograd's engine: a double backward through compiled code.

"torch.compile with aot_autograd does not currently support double backward" is raised while the
probe differentiates a force term, at gradprobe's own ``autograd.grad`` call: the traceback holds no
frame of the user's (or a package's) code. Autograd's anomaly mode records, for every backward node,
the traceback of the forward call that made it; the node that fails is the compiled function's backward,
made where the code called ``autograd.grad(..., create_graph=True)``. One scenario is run again under
anomaly mode (no recompile: dynamo does not guard on it) and that frame becomes ``RunError.where``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import torch

from ..frames import user_frame_in_text
from ..measure import Measurement

DOUBLE_BACKWARD = "does not currently support double backward"
_FORWARD_TRACE = "Traceback of forward call that caused the error"


def frame_of_failing_node(rerun: Callable[[], Any]) -> dict[str, Any] | None:
    """Run ``rerun()`` under anomaly mode; the user's frame of the forward call whose backward node
    failed (None when anomaly mode names none)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # The failure itself is already recorded; only its forward trace is wanted.
        with torch.autograd.detect_anomaly(check_nan=False), contextlib.suppress(Exception):
            rerun()
    for w in caught:
        text = str(w.message)
        if _FORWARD_TRACE in text:
            return user_frame_in_text(text.split(_FORWARD_TRACE, 1)[1].split("Previous calculation", 1)[0])
    return None


def with_double_backward_frames(
    results: Sequence[Measurement], rerun: Callable[[str], Any]
) -> list[Measurement]:
    """Runs that failed with a double backward and name no frame get the one anomaly mode gives
    (``rerun(scenario)`` measures that scenario again; done once per variant)."""
    failing = [
        m for m in results
        if m.error is not None and m.error.where is None and DOUBLE_BACKWARD in m.error.message
    ]  # fmt: skip
    if not failing:
        return list(results)
    where = frame_of_failing_node(lambda: rerun(failing[0].scenario))
    if where is None:
        return list(results)
    return [
        dataclasses.replace(m, error=msgspec.structs.replace(m.error, where=where))
        if any(m is f for f in failing)  # by identity: measurements compare their norm lists otherwise
        else m
        for m in results
    ]
