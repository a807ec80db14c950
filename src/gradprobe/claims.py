"""Findings are claims over evidence: each clause a finding states is a ``Claim`` — a predicate named
here, its arguments, and the sentence it renders to — that can be checked again on the flow map alone.

A detector writes ``claim("fd", text, variant=..., term=..., ...)``; ``holds(fm, c)`` re-evaluates it on
the evidence the map stores (cells, runs, lineage, the gradients check, bisection trials, dynamo's
events, checks, notes); ``audit(fm)`` lists every finding whose claims are missing or do not hold. The
test suite audits every map it makes (``tests/conftest.py``). A sentence with no predicate here cannot
be written into a finding's claims: the vocabulary of what gradprobe can say is this module.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .flowmap import Claim, FlowMap

PREDICATES: dict[str, Callable[..., bool]] = {}


def _predicate(fn: Callable[..., bool]) -> Callable[..., bool]:
    PREDICATES[fn.__name__] = fn
    return fn


def claim(predicate: str, text: str, /, **args: Any) -> Claim:
    """A claim of ``predicate`` with ``args``, rendered as ``text``."""
    if predicate not in PREDICATES:
        raise ValueError(f"no predicate {predicate!r}: a finding can only claim what gradprobe can check")
    return Claim(predicate, text, args)


def holds(fm: FlowMap, c: Claim) -> bool:
    try:
        return bool(PREDICATES[c.kind](fm, **c.args))
    except (KeyError, TypeError, ValueError):  # an unknown predicate, arguments or evidence that is not there
        return False


def audit(fm: FlowMap) -> list[str]:
    """What is wrong with the map's findings' claims: a finding with none, a claim that does not hold."""
    problems = []
    for f in fm.findings:
        if not f.claims:
            problems.append(f"{f.cause}: no claims")
        for c in f.claims:
            if not holds(fm, c):
                problems.append(f"{f.cause}: claim {c.kind}({c.args}) does not hold: {c.text}")
    return problems


def _sub(names: Iterable[str], pool: Iterable[str]) -> bool:
    return set(names) <= set(pool)


def _lineage(fm: FlowMap, variant: str) -> Mapping[str, Any]:
    return (fm.evidence.get("lineage") or {})[variant]


def _same_file(a: Any, b: Any) -> bool:
    return os.path.basename(str(a)) == os.path.basename(str(b))


# ----- cells and runs -------------------------------------------------------------------------------


@_predicate
def statuses(fm: FlowMap, variant: str, scenario: str, parameters: list[str], status: list[str]) -> bool:
    """In that run, each of ``parameters`` has one of the statuses ``status``."""
    cells = fm.cells_of(variant, scenario)
    return bool(parameters) and all(p in cells and cells[p].status in status for p in parameters)


@_predicate
def count(fm: FlowMap, variant: str, scenario: str, reached: int) -> bool:
    """That run reaches ``reached`` trainable parameters."""
    return fm.run(variant, scenario).error is None and fm.count(variant, scenario)[0] == reached


@_predicate
def verdicts(
    fm: FlowMap, variant: str, scenario: str, parameters: list[str], verdict: list[str], at_least: float = 0.0
) -> bool:
    """In that run, each of ``parameters`` has one of the verdicts against the reference; the largest
    relative error among the wrong ones is at least ``at_least``."""
    cells = fm.cells_of(variant, scenario)
    if not parameters or not all(p in cells and cells[p].verdict in verdict for p in parameters):
        return False
    errors = [cells[p].rel_error for p in parameters if cells[p].rel_error is not None]
    return at_least <= 0 or (bool(errors) and max(errors) >= at_least * 0.999)


@_predicate
def run_failed(
    fm: FlowMap, variant: str, scenarios: list[str], type: str | None = None, contains: str = ""
) -> bool:
    """Those runs failed (with that exception type, and a message holding ``contains``)."""
    for s in scenarios:
        e = fm.run(variant, s).error
        if e is None or (type is not None and e.type != type) or contains not in f"{e.message}":
            return False
    return bool(scenarios)


@_predicate
def ran(fm: FlowMap, variant: str, scenarios: list[str]) -> bool:
    """Those runs of the path ran without error."""
    return bool(scenarios) and all(fm.run(variant, s).error is None for s in scenarios)


@_predicate
def failed_at(fm: FlowMap, variant: str, scenario: str, file: str, line: int) -> bool:
    """That run's (or the path's build's) failure came from that line of the user's code."""
    error = fm.run(variant, scenario).error or fm.variant(variant).error
    where = (error.where or {}) if error is not None else {}
    return _same_file(where.get("file"), file) and where.get("line") == line


@_predicate
def term_value(fm: FlowMap, variant: str, scenario: str, term: str, finite: bool) -> bool:
    """That run's value of ``term`` is (not) finite."""
    value = fm.run(variant, scenario).term_values.get(term)
    import math

    return value is not None and math.isfinite(value) == finite


# ----- lineage ----------------------------------------------------------------------------------------


@_predicate
def depends(fm: FlowMap, variant: str, term: str, parameters: list[str]) -> bool:
    """The recorded lineage says ``term``'s value depends on ``parameters`` in that path."""
    tl = _lineage(fm, variant)["terms"][term]
    return _sub(parameters, tl.get("depends_on") or ())


@_predicate
def site(fm: FlowMap, variant: str, kind: str, file: str, line: int, parameters: list[str] = ()) -> bool:  # type: ignore[assignment]
    """The lineage of that path has a site of ``kind`` at that line, carrying ``parameters``."""
    return any(
        s.get("kind") == kind
        and _same_file(s.get("file"), file)
        and s.get("line") == line
        and _sub(parameters, s.get("parameters") or ())
        for s in _lineage(fm, variant).get("sites") or ()
    )


@_predicate
def mode_call(fm: FlowMap, variant: str, module: str, mode: str, file: str, line: int) -> bool:
    """The step called ``module.train(mode == 'train')`` (``.eval()``) at that line while recorded."""
    return any(
        c.get("module") == module
        and c.get("mode") == mode
        and _same_file(c.get("file"), file)
        and c.get("line") == line
        for c in _lineage(fm, variant).get("mode_calls") or ()
    )


@_predicate
def no_mode_call(fm: FlowMap, variant: str) -> bool:
    """The step switched no module to eval mode while recorded (it arrived in eval mode)."""
    return not any(c.get("mode") == "eval" for c in _lineage(fm, variant).get("mode_calls") or ())


# ----- the gradients check, bisection, dynamo, checks, notes -------------------------------------------


@_predicate
def fd(
    fm: FlowMap, variant: str, term: str, status: str, parameters: list[str] = (), at_least: float = 0.0
) -> bool:  # type: ignore[assignment]
    """The gradients check of ``term`` in that path gave ``status``; where it disagrees, along
    ``parameters`` and by at least ``at_least`` (relative)."""
    entry = fm.checks["gradients"]["paths"][variant]["terms"][term]
    if entry.get("status") != status:
        return False
    return (
        _sub(parameters, entry.get("parameters") or ())
        and float(entry.get("rel_error") or 0) >= at_least * 0.999
    )


@_predicate
def trial(fm: FlowMap, variant: str, change: str, ok: bool) -> bool:
    """The bisection of that path ran a trial ``change`` whose flow matched the reference (``ok``) or not."""
    b = fm.bisection(variant) or {}
    return any(t.get("change") == change and bool(t.get("ok")) == ok for t in b.get("trials") or ())


@_predicate
def bisected(fm: FlowMap, variant: str, summary: str) -> bool:
    """The bisection of that path summarised itself so."""
    return (fm.bisection(variant) or {}).get("summary") == summary


@_predicate
def guard(fm: FlowMap, variant: str, guard: str) -> bool:
    """Dynamo's own recompile reasons for that path include the failed guard ``guard``."""
    runs = ((fm.evidence.get("dynamo") or {}).get(variant) or {}).get("runs") or {}
    return any(
        (c.get("reason") or {}).get("guard") == guard for w in runs.values() for c in w.get("compiles") or ()
    )


@_predicate
def ran_eager(fm: FlowMap, variant: str, scenarios: list[str]) -> bool:
    """In those runs of that path no compiled code ran (dynamo's events, or a DynamoFallback error)."""
    runs = ((fm.evidence.get("dynamo") or {}).get(variant) or {}).get("runs") or {}
    for s in scenarios:
        error = fm.run(variant, s).error
        if not (error is not None and error.type == "DynamoFallback") and (runs.get(s) or {}).get(
            "ran_compiled", True
        ):
            return False
    return bool(scenarios)


@_predicate
def check(fm: FlowMap, name: str, passed: bool, variant: str | None = None) -> bool:
    """The check ``name`` (for ``variant`` where it is per path) passed or failed."""
    result = fm.checks[name]
    if variant is not None:
        result = (result.get("variants") or result)[variant]
    return bool(result.get("passed")) == passed


@_predicate
def noted(fm: FlowMap, parameters: list[str]) -> bool:
    """The spec's notes declare every one of ``parameters`` (by name or prefix)."""
    from .declarations import note_for

    return bool(parameters) and all(note_for(p, fm.notes) is not None for p in parameters)


@_predicate
def environment(fm: FlowMap, key: str) -> bool:
    """The probe recorded this fact of its environment (``evidence.environment``)."""
    return bool((fm.evidence.get("environment") or {}).get(key))


# ----- predicates of the compile and failure causes (bisections, signatures, advice) --------------------


# ----- predicates of the value, flow and check causes ----------------------------------------------------
