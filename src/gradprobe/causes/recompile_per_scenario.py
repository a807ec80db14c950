"""recompile-per-scenario: a compiled path recompiles per scenario, or runs no compiled code in some
scenarios (it measured eager there).

Evidence: dynamo's own events for every path, whoever called ``torch.compile`` (``evidence.dynamo``:
frames compiled per scenario with dynamo's recompile reason — the guard that failed and the user's
line — and runs in which no compiled code ran); for gradprobe's own variants and paths that hand over
a counter, the compile counter and the runs in which it saw no compiled code run.

The finding says what dynamo recorded and nothing beyond it: the failed guard and its frame. Only a
guard on a Python number or bool that is a local or stack value (not an object's attribute) compared
with a value the per-term weights take (0 or 1) is read as a weight turned into a Python number, with
"pass 0-dim tensors" as the fix; a guard on anything else is named with "cause not known" beyond it;
runs without compiled code and no recompile reason are said to be so, not explained.
"""

from __future__ import annotations

import re
from typing import Any

from ..claims import claim
from ..flowmap import Finding, FlowMap
from .common import failed_runs, runs_of, where
from .compile_unsupported import unsupported
from .dynamo_disabled import disabled

CAUSE = "recompile-per-scenario"

_LITERAL = re.compile(r"^(?P<subject>.+?)\s*==\s*(?P<value>-?\d+(?:\.\d*)?(?:e-?\d+)?|True|False)$")
_HINT = re.compile(r"\(HINT: ([^)]*)\)")


def number_guard(guard: str) -> bool:
    """A guard comparing a local, a stack value or a dict/list item (not an object's attribute) with a
    value the per-term weights take, a bool or a float 0.0/1.0: ``___stack0 == True``, ``L['w'] == 1.0``
    (``L['step'] == 0``, an int, is a counter's value, not a weight's)."""
    m = _LITERAL.match(guard.strip())
    if m is None or "." in re.sub(r"\[[^\]]*\]", "", m["subject"]):
        return False
    if m["value"] in ("True", "False"):
        return True
    # A float 0.0 / 1.0 (a weight read with float() or .item()); an int literal is a counter's value.
    return "." in m["value"] and float(m["value"]) in (0.0, 1.0)


def _subject(guard: str) -> str:
    m = _LITERAL.match(guard.strip())
    return m["subject"].strip() if m is not None else guard.strip()


def _hint(reason: dict[str, Any]) -> str:
    m = _HINT.search(str(reason.get("text", "")))
    return m[1].strip() if m is not None else ""


def detect(fm: FlowMap) -> list[Finding]:
    if disabled(fm) is not None:
        return []  # nothing was compiled at all: dynamo-disabled says so
    findings = []
    dynamo = fm.evidence.get("dynamo") or {}
    names = fm.scenario_names
    for v in fm.variants:
        if unsupported(fm, v.name):
            continue  # dynamo could compile nothing of it: compile-unsupported says so, with its reason
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
        findings.append(_finding(fm, v.name, runs, recompiled, later, fallback, ran_eager))
    return findings


def _finding(
    fm: FlowMap,
    v: str,
    runs: list[Any],
    recompiled: list[tuple[str, list[dict[str, Any]]]],
    later: list[str],
    fallback: list[str],
    ran_eager: list[str],
) -> Finding:
    names = fm.scenario_names
    reasons = [c["reason"] for _, cs in recompiled for c in cs]
    by_guard: dict[str, dict[str, Any]] = {}
    for r in reasons:
        if r.get("guard"):
            by_guard.setdefault(r["guard"], r)
    guards = list(by_guard)
    first = next((r for r in reasons if r.get("file")), None)
    claims = []
    parts = []
    if later:
        how = "dynamo's recompile events" if recompiled else "the path's compile counter"
        parts.append(
            f"compiled again in {len(later)} of {len(names) - 1} later scenario(s) ({', '.join(later)})"
        )
        claims.append(claim("recompiled", f"{v} compiled again in {', '.join(later)} ({how})", variant=v,
                            scenarios=later))  # fmt: skip
    eager = fallback + ran_eager
    if eager:
        parts.append(
            f"ran no compiled code in {', '.join(eager)} (those runs measured eager code, not the compiled path)"
        )
        claims.append(claim("ran_eager", f"no compiled code ran in {', '.join(eager)} of {v}", variant=v,
                            scenarios=eager))  # fmt: skip
    message = f"{v} " + " and ".join(parts)
    shown = guards[:3]
    for g in shown:
        r = by_guard[g]
        claims.append(claim("guard_at", f"dynamo's guard {g} failed" + (f" at {where(r)}" if r.get("file") else ""),
                            variant=v, guard=g, file=r.get("file"), line=r.get("line")))  # fmt: skip
    if guards:
        message += f": dynamo's guard failed: {'; '.join(shown)}"
        if first is not None:
            message += f" at {where(first)}"
        numbers = [g for g in shown if number_guard(g)]
        others = [g for g in shown if g not in numbers]
        hints = {g: h for g in others if (h := _hint(by_guard[g]))}
        said = list(dict.fromkeys(hints.values()))
        for g, h in hints.items():
            claims.append(claim("guard_hint", f"dynamo's hint on {g}: {h}", variant=v, guard=g, hint=h))
        if numbers:
            message += (
                f"; {', '.join(numbers)} compare{'s' if len(numbers) == 1 else ''} a Python number or bool (a local "
                "or stack value, not an object's attribute) with a value the per-term weights take (0 or 1)"
            )
        if others:
            message += (
                f"; {', '.join(others)}: the value the guard reads changed between calls"
                + "".join(f" (dynamo's hint: {h})" for h in said)
                + "; cause not known beyond the guard"
            )
        fix = _fix(guards, numbers, others)
    else:
        claims.append(claim("no_recompile_reason", f"dynamo recorded no recompile reason for {v}", variant=v))
        message += "; dynamo recorded no recompile reason for this path"
        said = []
        for s in fallback:
            e = fm.run(v, s).error
            if e is not None and e.message not in said:
                said.append(e.message)
        if said:
            message += "; the path's counter says: " + " / ".join(said[:2])
            s0 = fallback[0]
            claims.append(claim("run_failed", f"{s0} of {v}: {said[0]}", variant=v, scenarios=[s0],
                                type="DynamoFallback", contains=said[0]))  # fmt: skip
        message += "; cause not known"
        fix = (
            "find why the path ran no compiled code in those runs (dynamo logs its decisions with "
            "TORCH_LOGS=recompiles,graph_breaks); the recorded facts above are all that was measured"
            if eager
            else "find what changes between the path's calls (TORCH_LOGS=recompiles shows dynamo's reasons)"
        )
    return Finding(
        CAUSE,
        "error",
        message,
        evidence={
            "variant": v,
            "runs": runs_of(v, eager),
            "compiled_graphs": {r.scenario: r.compiled_graphs for r in runs},
            "guards": guards,
            "reasons": reasons,
            "recompiled": later,
            "ran_eager": eager,
        },
        location={
            "variant": v,
            **({k: first[k] for k in ("file", "line", "code")} if first else {}),
            **({"guard": guards[0]} if guards else {}),
        },
        fix=fix,
        claims=tuple(claims),
    )


def _fix(guards: list[str], numbers: list[str], others: list[str]) -> str:
    out = []
    text = " ".join(guards)
    if numbers:
        out.append(
            "pass loss weights and flags as 0-dim tensors and multiply (w * term), never float(w), bool(w), "
            "w.item() or `if w:` inside the compiled step (not tried)"
        )
    if "dtype" in text:
        out.append("keep the dtype the guard checks fixed between calls (not tried)")
    elif "grad_mode" in text or "GLOBAL_STATE" in text:
        out.append(
            "set grad mode (or the global state the guard checks) outside the compiled region (not tried)"
        )
    elif others:
        out.append(
            f"keep what the guard reads ({', '.join(dict.fromkeys(_subject(g) for g in others))}) fixed between "
            "calls, or outside the compiled region (not tried)"
        )
    return "; ".join(out)
