"""nonfinite-term: a term's value (or a run's total loss) is NaN or Inf.

Its gradients may all be finite: a NaN that enters through a part without gradient (a label, a
detached tensor, a constant) leaves every cell ``nonzero`` while the loss being trained is NaN. The
cells alone would call that run healthy; the term values say otherwise. A term whose gradient is
non-finite too, wherever it is switched on, is left to ``nonfinite-grad``, which names the op.

Evidence: the term values and totals of every run.
"""

from __future__ import annotations

import math

from ..claims import claim
from ..flowmap import Finding, FlowMap
from ..status import INF, NAN
from ..wording import names

CAUSE = "nonfinite-term"


def _bad(x: float | None) -> bool:
    return x is not None and not math.isfinite(x)


def detect(fm: FlowMap) -> list[Finding]:
    switched_on = {s.name: set(s.terms) for s in fm.scenarios}
    findings = []
    for v in fm.variant_names:
        runs = [r for r in fm.runs if r.variant == v]
        nonfinite_grads = {r.scenario for r in runs if fm.with_status(v, r.scenario, NAN, INF)}
        values: dict[str, float] = {}  # term -> its first non-finite value
        scenarios: list[str] = []
        claims = []
        for r in runs:
            bad = {t: x for t, x in r.term_values.items() if _bad(x)}
            # A term whose gradient is non-finite wherever it is switched on is nonfinite-grad's: the
            # op that makes both is named there.
            bad = {
                t: x
                for t, x in bad.items()
                if not any(t in on and s in nonfinite_grads for s, on in switched_on.items())
            }
            total_only = not r.term_values and _bad(r.total) and r.scenario not in nonfinite_grads
            if bad or total_only:
                scenarios.append(r.scenario)
            for t, x in bad.items():
                if t not in values:
                    claims.append(claim("term_value", f"{t} = {x} in {r.scenario}", variant=v, scenario=r.scenario,
                                        term=t, finite=False))  # fmt: skip
                values.setdefault(t, x)  # type: ignore[arg-type]
            if total_only:
                claims.append(claim("total_value", f"the total loss = {r.total} in {r.scenario}", variant=v,
                                    scenario=r.scenario, finite=False))  # fmt: skip
        if not scenarios:
            continue
        # The runs that switch those terms on (or all, for the total) and measured gradients.
        on = [
            s for s in scenarios
            if (not values or set(values) & switched_on[s]) and fm.cells_of(v, s)
        ]  # fmt: skip
        finite = (
            [claim("finite_grads", f"the gradients of {names(on)} are finite", variant=v, scenarios=on)]
            if on
            else []
        )
        what = "term(s) " + ", ".join(f"{t} = {x}" for t, x in values.items()) if values else "the total loss"
        findings.append(
            Finding(
                CAUSE,
                "error",
                f"{v}: {what} in {names(scenarios)}"
                + (
                    f", with finite gradients in {names(on)}: the NaN/Inf comes from a part of the value that "
                    "carries no gradient to the parameters"
                    if on
                    else ""
                )
                + "; training would step on while the loss is not a number",
                claims=(*claims, *finite),
                evidence={
                    "variant": v,
                    "terms": {t: str(x) for t, x in values.items()},
                    "runs": [[v, s] for s in scenarios],
                },
                location={"variant": v, "terms": list(values)} if values else {"variant": v},
                fix="find where the value stops being finite: check the batch and labels with torch.isfinite, "
                "and the detached or constant parts of the term (anomaly mode does not see them: they have no "
                "backward)",
            )
        )
    return findings
