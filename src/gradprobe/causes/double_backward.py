"""double-backward-unsupported: AOTAutograd cannot differentiate its own backward, so a compiled step
around ``autograd.grad(create_graph=True)`` raises at backward time."""

from __future__ import annotations

from ..flowmap import Finding, FlowMap
from .common import failed_runs, runs_of

CAUSE = "double-backward-unsupported"

PATTERNS = (
    "forces inside make_fx with detach decomposed to an alias, then compile the first-order graph "
    "(variant make_fx[detach=alias]+compile:<backend>; raw make_fx falls into makefx-detach); or "
    "torch._dynamo.config.trace_autograd_ops=True with requires_grad_ set by the caller; or forces via "
    "torch.func.grad; or backend='eager'"
)


def detect(fm: FlowMap) -> list[Finding]:
    findings = []
    for v in fm.variants:
        failed = failed_runs(fm, v.name, lambda e: "double backward" in e.message)
        if not failed:
            continue
        bis = fm.bisection(v.name)
        fix = (bis or {}).get("fix")
        verified = (
            f" Verified here: {fix['variant']} {'matches' if fix['ok'] else 'does not match'} {fm.reference}."
            if fix
            else ""
        )
        findings.append(
            Finding(
                CAUSE,
                "error",
                f"{v.name} raises at backward in {len(failed)} scenario(s): torch.compile with aot_autograd does not "
                "support double backward (the step differentiates with create_graph=True inside the compiled region)",
                evidence={"variant": v.name, "runs": runs_of(v.name, failed), "bisection": bis},
                location={"variant": v.name, "backend": v.backend},
                fix=f"patterns that work on this torch: {PATTERNS}.{verified}",
            )
        )
    return findings
