"""backend-drops-grads: counts or values change at one backend of the ladder and not before, with the
capture (and its detach handling) already right."""

from __future__ import annotations

from ..flowmap import Finding, FlowMap
from .common import differing, runs_of

CAUSE = "backend-drops-grads"


def detect(fm: FlowMap) -> list[Finding]:
    findings = []
    for b in fm.bisections:
        culprit = b.get("culprit") or {}
        if b.get("stage") != "compile" or not culprit.get("ladder"):
            continue
        v = b["variant"]
        if any("double backward" in (r.error.message if r.error else "") for r in fm.runs if r.variant == v):
            continue  # that is double-backward-unsupported
        bad = differing(fm, v)
        lost = sorted({p for s in bad for p, c in fm.differences(v, s).items()})
        last = culprit.get("last_good")
        findings.append(
            Finding(
                CAUSE,
                "error",
                f"backend {culprit['backend']} changes the gradients of {v}: {', '.join(bad)} differ from "
                f"{fm.reference} ({', '.join(lost[:6])}); the traced graph without it is right"
                + (f", {last} is right too" if last else ""),
                evidence={"variant": v, "runs": runs_of(v, bad), "bisection": b, "parameters": lost},
                location={"variant": v, "backend": culprit["backend"]},
                fix=(
                    f"use backend {last} (the last good one on the ladder)" if last else "use another backend"
                )
                + "; hand the graph to torch._inductor.compiler_bisector (inductor) or bisect the backend's passes",
            )
        )
    return findings
