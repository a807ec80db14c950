"""The catalogue of known causes: one module per cause, each exporting ``detect(fm) -> list[Finding]``."""

from __future__ import annotations

from collections.abc import Callable

from ..flowmap import Finding, FlowMap
from . import nonfinite_grad, run_failed, unused_parameter

Detector = Callable[[FlowMap], list[Finding]]

DETECTORS: tuple[Detector, ...] = (
    run_failed.detect,
    nonfinite_grad.detect,
    unused_parameter.detect,
)
