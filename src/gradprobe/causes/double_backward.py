"""double-backward-unsupported: AOTAutograd cannot differentiate its own backward, so a compiled step
around ``autograd.grad(create_graph=True)`` raises at backward time.

Evidence: the runs that raise with that message, the runs of the path that ran (the model compiled
alone: first-order terms run), the create_graph call's line (anomaly mode's forward trace). The
patterns that work are advice from trials (``common.advice``): verified where a bisection trial or a
path the probe measured shows them matching the reference, never given where one refuted them
(``backend='eager'`` on a model whose eager-backend compile drops the force gradients), "not tried"
otherwise."""

from __future__ import annotations

from ..claims import claim
from ..flowmap import Finding, FlowMap
from .common import Candidate, advice, failed_runs, family, runs_of, where

CAUSE = "double-backward-unsupported"
SIGNATURE = "double backward"


def candidates(variant: str, separable: bool) -> list[Candidate]:
    """The patterns that work on torch 2.13 (DESIGN's measured facts), each with the paths that try it."""
    same = family(variant)
    out = [
        Candidate(
            "forces inside make_fx with detach decomposed to an alias, then compile the first-order graph "
            "(variant make_fx[detach=alias]+compile:<backend>; raw make_fx falls into makefx-detach)",
            lambda p: p["capture"] == "make_fx" and p["knobs"].get("detach") == "alias" and p["backend"],
        ),
        Candidate(
            "torch._dynamo.config.trace_autograd_ops=True with requires_grad_ set by the caller",
            lambda p: str(p["knobs"].get("trace_autograd_ops", "")).lower() == "true",
        ),
        Candidate("forces via torch.func.grad"),
        Candidate("backend='eager'", lambda p: same(p) and p["backend"] == "eager"),
    ]
    if not separable:
        out.append(
            Candidate(
                "compile the model only (compile_model:<backend>) to train the first-order terms compiled",
                lambda p: p["capture"] == "model",
                partial=True,
            )
        )
    return out


def detect(fm: FlowMap) -> list[Finding]:
    findings = []
    for v in fm.variants:
        failed = failed_runs(fm, v.name, lambda e: SIGNATURE in e.message)
        if not failed:
            continue
        bis = fm.bisection(v.name)
        ok = [s for s in fm.scenario_names if s not in failed and fm.run(v.name, s).error is None]
        where_ = (
            "a term differentiates the compiled model's backward again (create_graph=True around it)"
            if v.capture == "model"
            else "the step differentiates with create_graph=True inside the compiled region"
        )
        claims = [
            claim("run_failed", f"{v.name} raises '{SIGNATURE}' in {', '.join(failed)}", variant=v.name,
                  scenarios=failed, contains=SIGNATURE),
        ]  # fmt: skip
        if ok:
            split = (
                f"; {', '.join(ok)} run{'s' if len(ok) == 1 else ''} compiled: only the terms that differentiate "
                "twice fail"
            )
            claims.append(claim("ran", f"{', '.join(ok)} ran in {v.name}", variant=v.name, scenarios=ok))
        elif len(failed) == len(fm.scenarios) and any(len(s.terms) == 1 for s in fm.scenarios):
            split = (
                "; every scenario raises, those with a single term too: the terms are not separable in this "
                "path on this torch"
            )
        else:
            split = ""
        # The create_graph call whose compiled backward is differentiated again (anomaly mode's forward
        # trace of the failing node, evidence.anomaly): the user's or the package's own line.
        at_run = next(((s, e.where) for s in failed if (e := fm.run(v.name, s).error) and e.where), None)
        frame = at_run[1] if at_run else None
        at = f"; the create_graph gradient is taken at {where(frame)}" if frame else ""
        if at_run is not None and frame.get("file") and frame.get("line") is not None:
            claims.append(claim("failed_at", f"the failure of {at_run[0]} comes from {where(frame)}",
                                variant=v.name, scenario=at_run[0], file=frame["file"], line=frame["line"]))  # fmt: skip
        tips = advice(fm, v.name, candidates(v.name, separable=bool(ok)), failed)
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
                fix=f"ways around it known on torch 2.13, each as measured on this model: {tips.text}",
                claims=(*claims, *tips.claims),
            )
        )
    return findings
