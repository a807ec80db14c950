"""nonfinite-grad: a gradient holds NaN or Inf; the first op producing it is named where it can be found."""

from __future__ import annotations

from ..claims import claim
from ..flowmap import Finding, FlowMap
from ..status import INF, NAN
from ..wording import names
from .common import where

CAUSE = "nonfinite-grad"


def detect(fm: FlowMap) -> list[Finding]:
    located = [b for b in fm.breaks if b.get("kind") == "nonfinite"]
    findings = []
    for v in fm.variant_names:
        bad = {s: sorted(fm.with_status(v, s, NAN, INF)) for s in fm.scenario_names}
        bad = {s: ps for s, ps in bad.items() if ps}
        if not bad:
            continue
        params = sorted({p for ps in bad.values() for p in ps})
        message = (
            f"{v}: NaN/Inf gradients in {', '.join(bad)} for {len(params)} parameter(s): {names(params)}"
        )
        claims = [
            claim("statuses", f"{s}: NaN/Inf for {names(ps)}", variant=v, scenario=s, parameters=ps,
                  status=[NAN, INF])
            for s, ps in bad.items()
        ]  # fmt: skip
        if located:
            b = located[0]
            message += f" — first produced by {b.get('op')} at {where(b)}"
            claims.append(claim("located", f"first produced by {b.get('op')} at {where(b)}", kind="nonfinite",
                                op=str(b.get("op")), file=b.get("file"), line=b.get("line")))  # fmt: skip
        findings.append(
            Finding(
                CAUSE,
                "error",
                message,
                evidence={
                    "variant": v,
                    "scenarios": bad,
                    "break": located[0] if located else None,
                    "runs": [[v, s] for s in bad],
                },
                location=located[0] if located else None,
                claims=tuple(claims),
                fix="guard the op: compute sqrt/log/division on a safe value (torch.where on the INPUT, not only on "
                "the output: the backward of an unselected branch still multiplies 0 by inf)",
            )
        )
    return findings
