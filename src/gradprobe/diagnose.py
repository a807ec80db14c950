"""Diagnosis: rules over the flow map's evidence, each in its own module under ``causes/``.

A detector is a function ``detect(fm: FlowMap) -> list[Finding]``. It reads only evidence (cells, runs,
variant errors, notes), never how the model was built. Adding a cause is adding one module and listing
it in ``causes.DETECTORS``.
"""

from __future__ import annotations

from .causes import DETECTORS
from .flowmap import Finding, FlowMap

_SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


def diagnose(fm: FlowMap) -> list[Finding]:
    """Every detector's findings, most important first (errors, then warnings, then info)."""
    findings = [f for detect in DETECTORS for f in detect(fm)]
    return sorted(findings, key=lambda f: _SEVERITY_ORDER[f.severity])
