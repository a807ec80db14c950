"""Diagnosis: rules over the flow map's evidence, each in its own module under ``causes/``.

A detector reads only evidence (cells, runs, variant errors, what ``gradprobe.evidence`` gathered:
lineage, confirmations, dynamo events, graph lint, bisections; checks; notes), never how the model was
built or which zoo switch is on. Specific causes
run first; the generic ones (run-failed, flow-mismatch, unused-parameter) report only what no specific
cause explained. Adding a cause is adding one module and listing it in ``causes.SPECIFIC``.
"""

from __future__ import annotations

from .causes import GENERIC, SPECIFIC
from .causes.common import Explained
from .flowmap import Finding, FlowMap

_SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


def diagnose(fm: FlowMap) -> list[Finding]:
    """Every detector's findings, most important first (errors, then warnings, then info)."""
    findings = [f for detect in SPECIFIC for f in detect(fm)]
    explained = Explained()
    for f in findings:
        explained.add(f.evidence)
    for detect in GENERIC:
        found = detect(fm, explained)
        for f in found:
            explained.add(f.evidence)
        findings += found
    return sorted(findings, key=lambda f: _SEVERITY_ORDER[f.severity])
