"""dead-term: a term reaches no parameter in the reference path and no cut explains it: its value
depends on no parameter at all (a loss computed from the labels alone, a term built from a copy of
the data), or it has no gradient path. An error by itself: the reference is what others are
compared with.

Evidence: the reference's runs, and with ``diagnose=True`` the lineage of its step (the term depends
on no parameter by value: not a cut, or a more specific cause would have named it).
"""

from __future__ import annotations

from ..flowmap import Finding, FlowMap
from ..status import INF, NAN, NONZERO
from .common import Explained

CAUSE = "dead-term"


def detect(fm: FlowMap, explained: Explained | None = None) -> list[Finding]:
    skip = explained.runs if explained is not None else set()
    ref = fm.reference
    lineage = ((fm.evidence.get("lineage") or {}).get(ref) or {}).get("terms") or {}
    findings = []
    for s in fm.scenarios:
        if len(s.terms) != 1 or (ref, s.name) in skip:
            continue
        (term,) = s.terms
        run = fm.run(ref, s.name)
        no_path = run.error is not None and run.error.type == "NoGradPath"
        reaches = fm.with_status(ref, s.name, NONZERO, NAN, INF)
        if not no_path and (run.error is not None or reaches):
            continue  # it reaches something, failed otherwise, or is non-finite (nonfinite-grad)
        depends = (lineage.get(term) or {}).get("depends_on")
        why = (
            "its value depends on no parameter (lineage of the step)"
            if depends == []
            else "it has no gradient path to any parameter"
            + ("" if lineage else " (run with diagnose=True to see whether and where it is cut)")
        )
        findings.append(
            Finding(
                CAUSE,
                "error",
                f"term {term} reaches no parameter in the reference path {ref}: {why}",
                evidence={
                    "term": term,
                    "runs": [[ref, x.name] for x in fm.scenarios if term in x.terms],
                    "depends_on": depends,
                },
                location={"term": term, "variant": ref},
                fix=f"make {term} a function of the model's output (check which tensors it is computed from), or "
                "drop it from the loss",
            )
        )
    return findings
