"""double-backward-unsupported: AOTAutograd cannot differentiate its own backward, so a compiled step
around ``autograd.grad(create_graph=True)`` raises at backward time."""

from __future__ import annotations

from ..flowmap import Finding, FlowMap
from .common import failed_runs, runs_of, where

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
        ok = [s for s in fm.scenario_names if s not in failed and fm.run(v.name, s).error is None]
        where_ = (
            "a force-like term differentiates the compiled model's backward again (create_graph=True around it)"
            if v.capture == "model"
            else "the step differentiates with create_graph=True inside the compiled region"
        )
        if ok:
            split = (
                f"; {', '.join(ok)} run{'s' if len(ok) == 1 else ''} compiled: only the terms that differentiate "
                "twice fail"
            )
        else:
            split = (
                "; every scenario raises, single terms too: the terms are not separable in this path on this "
                "torch (one compiled graph holds every term's backward). Compile the model only "
                "(compile_model:<backend>) to train the first-order terms compiled"
            )
        # The create_graph call whose compiled backward is differentiated again (anomaly mode's forward
        # trace of the failing node, evidence.anomaly): the user's or the package's own line.
        frame = next((e.where for s in failed if (e := fm.run(v.name, s).error) and e.where), None)
        at = f"; the create_graph gradient is taken at {where(frame)}" if frame else ""
        findings.append(
            Finding(
                CAUSE,
                "error",
                f"{v.name} raises at backward in {', '.join(failed)}: torch.compile with aot_autograd does not "
                f"support double backward ({where_}){at}{split}",
                evidence={
                    "variant": v.name,
                    "runs": runs_of(v.name, failed),
                    "bisection": bis,
                    "where": frame,
                },
                location={**(frame or {}), "variant": v.name, "backend": v.backend},
                fix=f"patterns that work on this torch: {PATTERNS}.{verified}",
            )
        )
    return findings
