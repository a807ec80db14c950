"""The catalogue of known causes: one module per cause, each exporting ``detect(fm) -> list[Finding]``."""

from __future__ import annotations

from collections.abc import Callable

from ..flowmap import Finding, FlowMap
from . import flow_mismatch, nonfinite_grad, run_failed, second_batch, unused_parameter

Detector = Callable[[FlowMap], list[Finding]]

DETECTORS: tuple[Detector, ...] = (
    run_failed.detect,
    flow_mismatch.detect,
    second_batch.detect,
    nonfinite_grad.detect,
    unused_parameter.detect,
)
