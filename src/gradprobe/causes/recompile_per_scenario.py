"""recompile-per-scenario: a compiled path recompiles per scenario, or silently runs eager past
dynamo's recompile limit, because something the compiled code reads changes between scenarios: a
per-term weight or flag turned into a Python number or bool, a metrics object's counter, a dtype or
grad-mode change.

Evidence: dynamo's own events for every path, whoever called ``torch.compile`` (``evidence.dynamo``:
frames compiled per scenario with dynamo's recompile reason — the guard that failed and the user's
line — and runs in which no compiled code ran); for gradprobe's own variants also the compile counter.
"""

from __future__ import annotations

import re
from typing import Any

from ..flowmap import Finding, FlowMap
from .common import failed_runs, runs_of, where
from .dynamo_disabled import disabled

CAUSE = "recompile-per-scenario"

_NUMBER = re.compile(r"==\s*-?\d|float|\bint\(|bool|___stack")


def _advice(guards: list[str]) -> str:
    text = " ".join(guards)
    if "dtype" in text:
        return "a tensor's dtype changes between calls: keep dtypes fixed inside the compiled region"
    if "grad_mode" in text or "GLOBAL_STATE" in text:
        return "grad mode (or another global state) changes between calls: set it outside the compiled region"
    if _NUMBER.search(text) and "." not in text.split("==")[0]:
        return (
            "pass loss weights and flags as 0-dim tensors and multiply (w * term), never float(w), bool(w), "
            "w.item() or `if w:` inside the compiled step"
        )
    return (
        "a Python value the compiled code reads changes every call (a counter or attribute of an object): "
        "keep it out of the compiled region, or hold it in a tensor"
    )


def detect(fm: FlowMap) -> list[Finding]:
    if disabled(fm) is not None:
        return []  # nothing was compiled at all: dynamo-disabled says so
    findings = []
    dynamo = fm.evidence.get("dynamo") or {}
    names = fm.scenario_names
    for v in fm.variants:
        events: dict[str, Any] = (dynamo.get(v.name) or {}).get("runs") or {}
        runs = [r for r in fm.runs if r.variant == v.name]
        recompiled = [
            (s, [c for c in events[s]["compiles"] if c.get("reason")]) for s in names[1:] if s in events
        ]
        recompiled = [(s, cs) for s, cs in recompiled if cs]
        later = [s for s, _ in recompiled] or (
            [r.scenario for r in runs[1:] if r.compiled_graphs] if not events else []
        )
        fallback = failed_runs(fm, v.name, lambda e: e.type == "DynamoFallback")
        compiled_somewhere = any(w.get("ran_compiled") for w in events.values()) or bool(
            ((dynamo.get(v.name) or {}).get("build") or {}).get("ran_compiled")
        )
        ran_eager = (
            [s for s in names if s in events and not events[s].get("ran_compiled")]
            if compiled_somewhere
            else []
        )
        ran_eager = [s for s in ran_eager if s not in fallback and fm.run(v.name, s).error is None]
        if not later and not fallback and not ran_eager:
            continue
        reasons = [c["reason"] for _, cs in recompiled for c in cs]
        guards = list(dict.fromkeys(r.get("guard", "") for r in reasons if r.get("guard")))
        first = next((r for r in reasons if r.get("file")), None)
        parts = []
        if later:
            parts.append(
                f"compiled again in {len(later)} of {len(names) - 1} later scenario(s) ({', '.join(later)})"
            )
        if fallback or ran_eager:
            parts.append(
                f"ran no compiled code in {', '.join(fallback + ran_eager)} (dynamo fell back to eager: those runs "
                "measured eager, not the compiled path)"
            )
        message = f"{v.name} " + " and ".join(parts)
        if guards:
            message += f": dynamo's guard failed: {'; '.join(guards[:3])}"
            if first is not None:
                message += f" at {where(first)}"
        else:
            message += (
                ": the step turns per-term weights or flags into Python numbers or bools inside the compiled "
                "region, so dynamo specialises the graph per scenario; past the recompile limit (8) it runs eager"
            )
        findings.append(
            Finding(
                CAUSE,
                "error",
                message,
                evidence={
                    "variant": v.name,
                    "runs": runs_of(v.name, fallback + ran_eager),
                    "compiled_graphs": {r.scenario: r.compiled_graphs for r in runs},
                    "guards": guards,
                    "reasons": reasons,
                    "recompiled": later,
                    "ran_eager": fallback + ran_eager,
                },
                location={
                    "variant": v.name,
                    **({k: first[k] for k in ("file", "line", "code")} if first else {}),
                    **({"guard": guards[0]} if guards else {}),
                },
                fix=_advice(guards),
            )
        )
    return findings
