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


def _runs_of(fm: FlowMap, variant: str) -> Mapping[str, Any]:
    return ((fm.evidence.get("dynamo") or {}).get(variant) or {}).get("runs") or {}


def _error_of(fm: FlowMap, variant: str, scenario: str | None) -> Any:
    """That run's error, or the path's build error (``scenario`` None, or a run that recorded none)."""
    error = fm.run(variant, scenario).error if scenario is not None else None
    return error or fm.variant(variant).error


@_predicate
def matches(fm: FlowMap, variant: str, scenarios: list[str]) -> bool:
    """Those runs of the path ran, and every cell matches the reference in reach and value."""
    return bool(scenarios) and all(
        fm.run(variant, s).error is None and fm.cells_of(variant, s) and not fm.differences(variant, s)
        for s in scenarios
    )


@_predicate
def differs(fm: FlowMap, variant: str, scenarios: list[str]) -> bool:
    """Each of those runs of the path failed, or has cells that differ from the reference."""
    return bool(scenarios) and all(
        fm.run(variant, s).error is not None or bool(fm.differences(variant, s)) for s in scenarios
    )


@_predicate
def build_failed(fm: FlowMap, variant: str, type: str | None = None, contains: str = "") -> bool:
    """The path's build failed (with that exception type, and a message holding ``contains``)."""
    e = fm.variant(variant).error
    return e is not None and (type is None or e.type == type) and contains in e.message


@_predicate
def build_failed_at(fm: FlowMap, variant: str, file: str, line: int) -> bool:
    """The path's build failure came from that line of the user's code."""
    error = fm.variant(variant).error
    where = (error.where or {}) if error is not None else {}
    return _same_file(where.get("file"), file) and where.get("line") == line


@_predicate
def error_frame(fm: FlowMap, variant: str, scenario: str | None, function: str) -> bool:
    """The recorded traceback of that run's (or the build's) error passes through ``function``."""
    error = _error_of(fm, variant, scenario)
    return error is not None and any(f.rpartition(" in ")[2] == function for f in error.frames or ())


@_predicate
def error_object(fm: FlowMap, variant: str, scenario: str | None, object_type: str) -> bool:
    """That failure's user frame is a method of an object of type ``object_type``."""
    error = _error_of(fm, variant, scenario)
    return error is not None and (error.where or {}).get("object_type") == object_type


@_predicate
def guard_at(fm: FlowMap, variant: str, guard: str, file: str | None = None, line: int | None = None) -> bool:
    """Dynamo recorded a recompile of that path whose failed guard is ``guard``, at that user line."""
    return any(
        (r := c.get("reason") or {}).get("guard") == guard
        and (file is None or _same_file(r.get("file"), file))
        and (line is None or r.get("line") == line)
        for w in _runs_of(fm, variant).values()
        for c in w.get("compiles") or ()
    )


@_predicate
def guard_hint(fm: FlowMap, variant: str, guard: str, hint: str) -> bool:
    """Dynamo's recorded reason for that failed guard carries that hint of its own."""
    return any(
        (r := c.get("reason") or {}).get("guard") == guard and hint in str(r.get("text", ""))
        for w in _runs_of(fm, variant).values()
        for c in w.get("compiles") or ()
    )


@_predicate
def no_recompile_reason(fm: FlowMap, variant: str) -> bool:
    """Dynamo recorded no recompile reason for that path (in its build or any run)."""
    d = (fm.evidence.get("dynamo") or {}).get(variant) or {}
    windows = [*(d.get("runs") or {}).values(), *([d["build"]] if d.get("build") else [])]
    return not any(c.get("reason") for w in windows for c in w.get("compiles") or ())


@_predicate
def recompiled(fm: FlowMap, variant: str, scenarios: list[str]) -> bool:
    """In each of those runs the path compiled again: dynamo recorded a recompile (with its reason), or,
    where dynamo recorded no events for the path, its compile counter grew."""
    runs = _runs_of(fm, variant)
    for s in scenarios:
        if runs:
            if not any(c.get("reason") for c in (runs.get(s) or {}).get("compiles") or ()):
                return False
        elif not fm.run(variant, s).compiled_graphs:
            return False
    return bool(scenarios)


@_predicate
def check_error(
    fm: FlowMap, check: str, contains: str = "", part: str | None = None, term: str | None = None
) -> bool:
    """The check (its ``part``: a balance part, a path of the physics or training check, and the
    ``term`` of a training run) could not run, with an error holding ``contains``."""
    result = fm.checks[check]
    if check == "balance" and part is not None:
        error = (result.get("errors") or {})[part]
    elif check == "physics_paths":
        error = result[part].get("error")
    elif check == "training" and part is not None:
        errors = (result.get("errors") or {})[part]
        error = errors[term] if term is not None else "; ".join(str(e) for e in errors.values())
    else:
        error = result.get("error")
    return bool(error) and contains in str(error)


@_predicate
def check_where(
    fm: FlowMap, check: str, file: str, line: int, part: str | None = None, term: str | None = None
) -> bool:
    """The check's recorded failure came from that line (its user frame)."""
    result = fm.checks[check]
    if check == "balance" and part is not None:
        where = (result.get("errors_where") or {})[part]
    elif check == "physics_paths":
        where = result[part].get("error_where")
    elif check == "training" and part is not None:
        where = ((result.get("errors_where") or {})[part])[term]
    else:
        where = result.get("error_where")
    where = where or {}
    return _same_file(where.get("file"), file) and where.get("line") == line


def _physics_of(fm: FlowMap, path: str) -> Mapping[str, Any]:
    return fm.checks["physics"] if path == fm.reference else fm.checks["physics_paths"][path]


@_predicate
def physics(fm: FlowMap, path: str, passed: bool, failure: str = "") -> bool:
    """The physics check of that path (the reference's, or a path checked on its own forces) passed or
    failed; failed with a failure line holding ``failure``."""
    result = _physics_of(fm, path)
    if bool(result.get("passed", True)) != passed:
        return False
    return not failure or any(failure in f for f in result.get("failures") or ())


@_predicate
def physics_cut(fm: FlowMap, path: str, kind: str, file: str, line: int) -> bool:
    """The physics check located a cut of that kind at that line on the way from the coordinates."""
    return any(
        c.get("kind") == kind and _same_file(c.get("file"), file) and c.get("line") == line
        for c in _physics_of(fm, path).get("cuts") or ()
    )


@_predicate
def outputs(fm: FlowMap, path: str, output: str, at_least: float) -> bool:
    """The path's own ``output`` (energy, force, virial) differs from the reference's by at least that
    (relative to its scale)."""
    e = (_physics_of(fm, path).get("outputs") or {})[output]
    return not e <= at_least * 0.999


@_predicate
def training(fm: FlowMap, variant: str, term: str, verdict: str) -> bool:
    """The training check's verdict on ``term`` in that path (decreases, flat, increases, error)."""
    return fm.checks["training"]["verdicts"][variant][term] == verdict


@_predicate
def shape_sweep(fm: FlowMap, variant: str, fails: bool, parameters: list[str] = ()) -> bool:  # type: ignore[assignment]
    """The shape sweep: on a batch of other shapes the path raised (``fails``), or ran with those
    parameters' gradients (or term values) differing from the reference's."""
    entry = fm.checks["shape_sweep"][variant]
    if fails:
        return bool(entry.get("error"))
    differ = list(entry.get("mismatched") or ()) + list(entry.get("term_values") or ())
    return not entry.get("error") and bool(differ) and _sub(parameters, differ)


@_predicate
def second_batch(fm: FlowMap, variant: str, parameters: list[str] = (), terms: list[str] = ()) -> bool:  # type: ignore[assignment]
    """On a second batch of the same shapes the path's gradients of ``parameters`` (and values of
    ``terms``) differ from the reference's."""
    sb = fm.variant(variant).second_batch or {}
    return (
        bool(parameters or terms)
        and _sub(parameters, sb.get("mismatched") or ())
        and _sub(terms, sb.get("term_values") or ())
    )


@_predicate
def independent(fm: FlowMap, variant: str, term: str, parameters: list[str]) -> bool:
    """The recorded lineage says ``term``'s value in that path does not depend on ``parameters``."""
    tl = _lineage(fm, variant)["terms"][term]
    return bool(parameters) and not set(parameters) & set(tl.get("depends_on") or ())


@_predicate
def lint(fm: FlowMap, variant: str, cutting_detach_nodes: int) -> bool:
    """The lint of the graph the path handed over counted that many detach nodes on parameter-dependent
    tensors."""
    return ((fm.variant(variant).graph or {}).get("cutting_detach_nodes") or 0) == cutting_detach_nodes


@_predicate
def path_advice(fm: FlowMap, variant: str, cause: str) -> bool:
    """The path handed over its own advice for that cause (``Built.advice``)."""
    return bool(((fm.evidence.get("advice") or {}).get(variant) or {}).get(cause)) or bool(
        ((fm.variant(variant).graph or {}).get("advice") or {}).get(cause)
    )


# ----- predicates of the value, flow and check causes ----------------------------------------------------
