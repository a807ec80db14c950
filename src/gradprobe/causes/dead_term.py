"""dead-term: a term reaches no parameter in the reference path and no cut explains it: its value
depends on no parameter at all (a loss computed from the labels alone, a term built from a copy of
the data), or it has no gradient path. An error by itself: the reference is what others are
compared with.

Evidence: the reference's runs, and with ``diagnose=True`` the lineage of its step (the term depends
on no parameter by value: not a cut, or a more specific cause would have named it).
"""

from __future__ import annotations

from ..claims import claim
from ..flowmap import Finding, FlowMap
from ..status import INF, NAN, NONE, NONZERO, ZERO
from ..wording import names
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
        trainable = list(fm.trainable)
        if no_path:
            what = claim("run_failed", f"{s.name}: no gradient path ({run.error.message})", variant=ref,
                         scenarios=[s.name], type="NoGradPath")  # fmt: skip
        else:
            zero = fm.with_status(ref, s.name, ZERO)
            said = (
                f"no gradient or an exact zero for every parameter ({len(zero)} exact zero)"
                if zero
                else "no gradient for any parameter"
            )
            what = claim("statuses", f"{s.name}: {said}", variant=ref, scenario=s.name, parameters=trainable,
                         status=[NONE, ZERO])  # fmt: skip
        claims = [what]
        if depends == []:
            claims.append(claim("depends_on_nothing", "its value depends on no parameter (lineage of the step)",
                                variant=ref, term=term))  # fmt: skip
        elif depends:
            claims.append(claim("depends", f"its value depends on {names(depends)} (lineage of the step)",
                                variant=ref, term=term, parameters=list(depends)))  # fmt: skip
        why = "; ".join(c.text for c in claims) + (
            "" if lineage else " (run with diagnose=True to see what its value depends on)"
        )
        findings.append(
            Finding(
                CAUSE,
                "error",
                f"term {term} reaches no parameter in the reference path {ref}: {why}",
                claims=tuple(claims),
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
