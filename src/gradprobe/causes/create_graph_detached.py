"""create-graph-detached: in one path an ``autograd.grad(..., create_graph=True)`` taken while the step ran
(forces inside a model's forward) returned its gradients with no graph: the values are right, the terms
built on them have no gradient path. Nothing raises.

Evidence (``evidence.grad_calls``, recorded around every run, whoever called ``torch.compile``): the call's
line, grad mode on, its differentiated outputs carrying a graph, its result carrying none — in the runs
of that path that failed (no gradient path) or differ from the reference; the same line's result carrying
a graph in the reference; and, where the graph behind the call passes through a custom
``autograd.Function`` that torch.compile traced (dynamo's ``autograd_function_apply``) with its backward
under grad mode off, that Function's line and its backward's: its second derivative is not recorded.
Measured on torch 2.13 with ``backend="eager"`` (``aot_eager`` raises double-backward-unsupported on the
same model instead). The fix is advice "(not tried)" unless a trial or a measured path shows it."""

from __future__ import annotations

from typing import Any

from ..claims import claim
from ..flowmap import Finding, FlowMap
from .common import Candidate, advice, has_run, runs_of, where

CAUSE = "create-graph-detached"
NO_PATH = "NoGradPath"  # measure.py: a scenario's total with no grad_fn


def _detached(call: dict[str, Any]) -> bool:
    return bool(
        call.get("create_graph")
        and call.get("grad_enabled")
        and call.get("outputs_graph")
        and not call.get("result_graph")
        and call.get(
            "result_nonzero"
        )  # None or zeros: an input the outputs never used (requires-grad-placement)
        and call.get("file")
        and call.get("line") is not None
    )


def _windows(fm: FlowMap, variant: str) -> dict[str, list[dict[str, Any]]]:
    runs = ((fm.evidence.get("dynamo") or {}).get(variant) or {}).get("runs") or {}
    return {name: w.get("grad_calls") or [] for name, w in runs.items()}


def detect(fm: FlowMap) -> list[Finding]:
    findings = []
    reference_calls = [c for calls in _windows(fm, fm.reference).values() for c in calls]
    for v in fm.variants:
        if v.name == fm.reference:
            continue
        windows = _windows(fm, v.name)
        by_line: dict[tuple[str, int], list[str]] = {}
        first: dict[tuple[str, int], dict[str, Any]] = {}
        for s in fm.scenario_names:
            run = fm.run(v.name, s) if has_run(fm, v.name, s) else None
            # A detached result that changed nothing measured is not this finding's, nor a run that
            # raised something else (another cause's signature).
            if run is None or not (
                (run.error is not None and run.error.type == NO_PATH)
                or (run.error is None and fm.differences(v.name, s))
            ):
                continue
            for c in windows.get(s) or ():
                if _detached(c):
                    key = (c["file"], c["line"])
                    by_line.setdefault(key, []).append(s)
                    first.setdefault(key, c)
        for (file, line), scenarios in by_line.items():
            call = first[(file, line)]
            findings.append(_finding(fm, v.name, call, scenarios, reference_calls))
    return findings


def _finding(
    fm: FlowMap, v: str, call: dict[str, Any], scenarios: list[str], reference_calls: list[dict[str, Any]]
) -> Finding:
    file, line = call["file"], call["line"]
    at = where(call)
    failed = [s for s in scenarios if fm.run(v, s).error is not None]
    differ = [s for s in scenarios if s not in failed]
    lost = sorted({p for s in differ for p in fm.differences(v, s)})
    claims = [
        claim("grad_call", f"autograd.grad(create_graph=True) at {at} returned gradients with no graph in "
              f"{', '.join(scenarios)} of {v} (grad mode on, its outputs carrying a graph)", variant=v,
              file=file, line=line, graph=False, scenarios=scenarios),
    ]  # fmt: skip
    said = [f"{v}: autograd.grad(create_graph=True) at {at} returned its gradients with no graph "
            f"(grad mode on, its outputs carrying one) in {', '.join(scenarios)}"]  # fmt: skip
    if failed:
        types = sorted({fm.run(v, s).error.type for s in failed})  # type: ignore[union-attr]
        claims.append(claim("run_failed", f"{', '.join(failed)} of {v} failed ({', '.join(types)})", variant=v,
                            scenarios=failed, type=types[0] if len(types) == 1 else None))  # fmt: skip
        said.append(
            f"{', '.join(failed)} {'has' if len(failed) == 1 else 'have'} no gradient path ({', '.join(types)})"
        )
    if differ:
        claims.append(claim("differs", f"{', '.join(differ)} of {v} differ from {fm.reference}", variant=v,
                            scenarios=differ))  # fmt: skip
        said.append(f"{', '.join(differ)} differ{'s' if len(differ) == 1 else ''} from {fm.reference}")
    same = [
        c
        for c in reference_calls
        if c.get("file") == file and c.get("line") == line and c.get("result_graph")
    ]
    if same and same[0].get("grad_enabled") and same[0].get("outputs_graph"):
        claims.append(claim("grad_call", f"in {fm.reference} the same call returns gradients with a graph",
                            variant=fm.reference, file=file, line=line, graph=True))  # fmt: skip
        said.append(f"in {fm.reference} the same call returns them with a graph")
    physics = (fm.checks.get("physics_paths") or {}).get(v)
    if isinstance(physics, dict) and physics.get("passed") and not physics.get("skipped"):
        claims.append(claim("physics", f"{v}'s own forces pass the physics check", path=v, passed=True))
        said.append(
            "the path's own forces pass the physics check: the values are right, only their graph is gone"
        )
    bis = fm.bisection(v) or {}
    if bis.get("summary"):
        claims.append(claim("bisected", f"bisect: {bis['summary']}", variant=v, summary=bis["summary"]))
        said.append(f"bisect: {bis['summary']}")
    traced = [t for t in call.get("traced_functions") or () if t.get("grad_off") and t.get("applied_at")]
    candidates = []
    for t in traced[:3]:
        applied, back = t["applied_at"], t.get("backward_at") or {}
        claims.append(claim("traced_backward", f"the graph it differentiates passes through a custom "
                            f"autograd.Function applied at {where(applied)}, traced by torch.compile with its "
                            "backward under grad mode off", variant=v, scenario=scenarios[0],
                            file=applied["file"], line=applied["line"], grad_off=True))  # fmt: skip
        said.append(
            f"the graph it differentiates passes through a custom autograd.Function applied at {where(applied)} "
            "that torch.compile traced with its backward under grad mode off"
            + (f" (traced from {where(back)})" if back else "")
            + ": that backward's own derivative is not recorded"
        )
        fn = applied.get("function")
        candidates.append(
            Candidate(
                "run the custom autograd.Function outside the compiled region"
                + (f" (torch.compiler.disable on {fn})" if fn else "")
                + f", applied at {where(applied)}"
            )
        )
    candidates.append(
        Candidate("take the create_graph gradient outside the compiled region (compile the energy only)")
    )
    tips = advice(fm, v, candidates, scenarios)
    return Finding(
        CAUSE,
        "error",
        "; ".join(said),
        evidence={
            "variant": v,
            "runs": runs_of(v, scenarios),
            "parameters": lost,
            "call": {k: call.get(k) for k in ("file", "line", "function", "code")},
            "traced_functions": traced,
        },
        location={
            "variant": v,
            **{k: call[k] for k in ("file", "line", "function", "code") if call.get(k) is not None},
        },
        fix=tips.text,
        claims=(*claims, *tips.claims),
    )
