"""Facts about a flow map that decide which detectors can find anything in it.

Every detector reads some kind of evidence: another variant to compare with, a failed run, the lineage
of a step, a bisection, a check's result, a declaration, a non-finite value, something dynamo did. A
detector whose evidence is absent returns nothing, so ``diagnose`` does not call it: a module declares
``READS``, the facts of which one must hold for it to run (none declared: it always runs). A probe of
one healthy eager path, the most common one, then runs the two detectors that read its cells alone
instead of all 26.

``facts`` is computed once per diagnosis from what the flow map holds, never from how it was made. The
test suite runs every diagnosis with and without the gate (``GRADPROBE_VERIFY_GATES=1``, set in
``tests/conftest.py``) and requires the same findings, on every flow map it builds.
"""

from __future__ import annotations

import math
from typing import Any

from ..status import INF, NAN

VARIANTS = "variants"  # more than one variant: something to compare with the reference
ERRORS = "errors"  # a failed run or a failed build
LINEAGE = "lineage"  # the lineage recording of ``diagnose=True``
BISECTIONS = "bisections"  # a bisection of a failing variant
CHECKS = "checks"  # a check's result (consistency, physics, training, balance, shapes)
EXPECT = "expect"  # declarations of what each scenario reaches
NONFINITE = "nonfinite"  # a NaN or Inf gradient, term value or total
DYNAMO = "dynamo"  # dynamo compiled, ran compiled code, hit its cache or broke a graph in some run


def facts(fm: Any) -> frozenset[str]:
    """The facts that hold for ``fm`` (a ``FlowMap``)."""
    out = set()
    if len(fm.variants) > 1:
        out.add(VARIANTS)
    if any(v.error is not None for v in fm.variants) or any(r.error is not None for r in fm.runs):
        out.add(ERRORS)
    evidence = fm.evidence or {}
    if evidence.get("lineage"):
        out.add(LINEAGE)
    if fm.bisections:
        out.add(BISECTIONS)
    if fm.checks:
        out.add(CHECKS)
    if fm.expect:
        out.add(EXPECT)
    if _nonfinite(fm):
        out.add(NONFINITE)
    if _dynamo_acted(fm, evidence.get("dynamo") or {}):
        out.add(DYNAMO)
    return frozenset(out)


def _nonfinite(fm: Any) -> bool:
    """A NaN or Inf status, term value or total. Values are summed (NaN and Inf carry through a sum): a
    sum of finite values past float's range also reads as non-finite, which only lets the non-finite
    detectors look (they find nothing then)."""
    for r in fm.runs:
        values = [x for x in r.term_values.values() if isinstance(x, float)]
        if isinstance(r.total, float):
            values.append(r.total)
        if not math.isfinite(sum(values)):
            return True
    return any(NAN in groups or INF in groups for groups in fm._by_status.values())


def _dynamo_acted(fm: Any, dynamo: dict[str, Any]) -> bool:
    if any(r.compiled_graphs for r in fm.runs):
        return True
    for per_variant in dynamo.values():
        if not isinstance(per_variant, dict):
            return True  # a shape this module does not know: let every detector look
        windows = [per_variant.get("build"), *(per_variant.get("runs") or {}).values()]
        for w in windows:
            if w and (
                w.get("compiles") or w.get("cache_hits") or w.get("graph_breaks") or w.get("ran_compiled")
            ):
                return True
    return False
