"""compile-unsupported: dynamo could not compile the frames of a compiled path — its own record says so:
the frame, an ``Unsupported`` failure with dynamo's explanation and hints (``nn.GRU`` with
``allow_rnn`` off, measured on torch 2.13) — and no compiled code ran in any of the path's runs: they
measured eager execution of its code, not compiled training. Not a recompile, not dynamo switched
off for the process (``dynamo-disabled``).

A path of gradprobe's (whose compile counter saw nothing run: those runs are recorded as failed) is an
error; the user's own path, whose runs are what their trainer does, a warning: its match with the
reference says nothing about compiled training.

Evidence: dynamo's compile events per window (``evidence.dynamo``: frame, file, line, ``ok``,
``fail_type``, ``fail_reason``) and the runs in which no compiled code ran.
"""

from __future__ import annotations

from typing import Any

from ..claims import claim
from ..flowmap import Finding, FlowMap
from .common import runs_of, where
from .dynamo_disabled import disabled

CAUSE = "compile-unsupported"


def _windows(fm: FlowMap, variant: str) -> list[dict[str, Any]]:
    d = (fm.evidence.get("dynamo") or {}).get(variant) or {}
    return [d.get("build") or {}, *(d.get("runs") or {}).values()]


def unsupported(fm: FlowMap, variant: str) -> list[dict[str, Any]]:
    """The compiles dynamo recorded as failed for ``variant`` when none of its windows ran compiled code
    (empty otherwise: a path that ran compiled code somewhere is not this). A path whose windows hold no
    compile at all gets the failures recorded in the other paths' windows, each with ``recorded_in``:
    dynamo does not try a frame again once it failed on it (measured on torch 2.13: ``compile_model``
    after ``compile`` of a step calling an ``nn.GRU`` records nothing of its own), so those are the
    only record of why."""
    windows = _windows(fm, variant)
    if any(w.get("ran_compiled") for w in windows) or not any(w is not None for w in windows[1:]):
        return []
    own = [c for w in windows for c in w.get("compiles") or () if c.get("ok") is False]
    info = fm.variant(variant)
    # Another path's record stands for this one only where this path compiles for sure (one of
    # gradprobe's compiled variants): a user's path or an uncompiled one may not compile at all.
    if own or any(w.get("compiles") for w in windows) or info.capture == "user" or info.backend is None:
        return own
    return [
        {**c, "recorded_in": other.name}
        for other in fm.variants
        if other.name != variant
        for w in _windows(fm, other.name)
        for c in w.get("compiles") or ()
        if c.get("ok") is False and c.get("fail_type")
    ]


def _hints(reason: str) -> list[str]:
    return [
        line.strip().removeprefix("Hint:").strip()
        for line in reason.splitlines()
        if line.strip().startswith("Hint:")
    ]


def detect(fm: FlowMap) -> list[Finding]:
    if disabled(fm) is not None:
        return []
    findings = []
    for v in fm.variants:
        failed = unsupported(fm, v.name)
        if not failed:
            continue
        runs = [r for r in fm.runs if r.variant == v.name]
        fallback = [r.scenario for r in runs if r.error is not None and r.error.type == "DynamoFallback"]
        events = ((fm.evidence.get("dynamo") or {}).get(v.name) or {}).get("runs") or {}
        eager = fallback + [r.scenario for r in runs if r.error is None and r.scenario in events]
        if not eager:
            continue
        first = failed[0]
        reason = str(first.get("fail_reason") or "")
        explanation = reason.strip().splitlines()[0] if reason.strip() else ""
        hints = _hints(reason)
        frames = list(dict.fromkeys(f"{c.get('frame')} ({where(c)})" for c in failed))
        elsewhere = first.get("recorded_in")
        message = (
            f"{v.name}: dynamo could not compile {', '.join(frames[:3])}: {first.get('fail_type')}"
            + (f": {explanation}" if explanation else "")
            + (
                f" (recorded in {elsewhere}'s run: dynamo does not try a frame again after such a failure, and "
                f"recorded no compile of its own for {v.name})"
                if elsewhere
                else ""
            )
            + f"; no compiled code ran in {', '.join(eager)}: those runs measured eager execution of its code, "
            "not the compiled path"
        )
        fix = (
            "dynamo's own hint: " + hints[0] + " (not tried)"
            if hints
            else "dynamo gives no hint: keep the frame dynamo cannot compile out of the compiled region, or compile "
            "what it calls instead (not tried)"
        )
        claims = [
            claim(
                "compile_failed",
                f"dynamo recorded a failed compile of {first.get('frame')} at {where(first)}"
                + (f" in {elsewhere}" if elsewhere else "")
                + f": {first.get('fail_type')}",
                variant=elsewhere or v.name,
                frame=first.get("frame"),
                file=first.get("file"),
                line=first.get("line"),
                fail_type=first.get("fail_type"),
            ),
            claim(
                "ran_eager",
                f"no compiled code ran in {', '.join(eager)} of {v.name}",
                variant=v.name,
                scenarios=eager,
            ),
        ]
        findings.append(
            Finding(
                CAUSE,
                "error" if fallback else "warning",
                message,
                evidence={"variant": v.name, "runs": runs_of(v.name, eager), "failed_compiles": failed},
                location={
                    "variant": v.name,
                    **{k: first[k] for k in ("file", "line") if first.get(k) is not None},
                },
                fix=fix,
                claims=tuple(claims),
            )
        )
    return findings
