"""Diagnosis: rules over the flow map's evidence, each in its own module under ``causes/``.

A detector reads only evidence (cells, runs, variant errors, what ``gradprobe.evidence`` gathered:
lineage, confirmations, dynamo events, graph lint, bisections; checks; notes), never how the model was
built or which zoo switch is on. Specific causes
run first; the generic ones (run-failed, flow-mismatch, unused-parameter) report only what no specific
cause explained. Adding a cause is adding one module and listing it in ``causes.SPECIFIC``.

A detector whose evidence is absent is not called (``causes.facts``: a module's ``READS``). With the
environment variable ``GRADPROBE_VERIFY_GATES=1`` (the test suite sets it) every diagnosis is also run
with every detector called, and a difference raises.
"""

from __future__ import annotations

import os
import sys

from .causes import GENERIC, SPECIFIC
from .causes.common import Explained
from .causes.facts import facts
from .flowmap import Finding, FlowMap

_SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}
_VERIFY_GATES = os.environ.get("GRADPROBE_VERIFY_GATES") == "1"


def _reads(detect: object) -> frozenset[str] | None:
    """The facts one of which a detector needs (its module's ``READS``); None, always run, when it
    declares none."""
    module = sys.modules.get(getattr(detect, "__module__", ""), None)
    return getattr(module, "READS", None)


_SPECIFIC = tuple((detect, _reads(detect)) for detect in SPECIFIC)
_GENERIC = tuple((detect, _reads(detect)) for detect in GENERIC)


def diagnose(fm: FlowMap) -> list[Finding]:
    """Every detector's findings, most important first (errors, then warnings, then info)."""
    found = _diagnose(fm, facts(fm))
    if _VERIFY_GATES:
        every = _diagnose(fm, None)
        if repr(every) != repr(found):
            raise AssertionError(
                "a detector's READS left out evidence it reads: gated findings "
                f"{[f.cause for f in found]} != every detector's {[f.cause for f in every]}"
            )
    return found


def _diagnose(fm: FlowMap, held: frozenset[str] | None) -> list[Finding]:
    """The findings of the detectors whose facts are ``held`` (None: of every detector)."""
    findings = [
        f for detect, reads in _SPECIFIC if held is None or reads is None or reads & held for f in detect(fm)
    ]
    explained = Explained()
    for f in findings:
        explained.add(f.evidence)
    for detect, reads in _GENERIC:
        if held is not None and reads is not None and not reads & held:
            continue
        found = detect(fm, explained)
        for f in found:
            explained.add(f.evidence)
        findings += found
    return sorted(findings, key=lambda f: _SEVERITY_ORDER[f.severity])
