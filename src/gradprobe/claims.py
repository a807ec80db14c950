"""Findings are claims over evidence: each clause a finding states is a ``Claim`` — a predicate named
here, its arguments, and the sentence it renders to — that can be checked again on the flow map alone.

A detector writes ``claim("fd", text, variant=..., term=..., ...)``; ``holds(fm, c)`` re-evaluates it on
the evidence the map stores (cells, runs, lineage, the gradients check, bisection trials, dynamo's
events, checks, notes); ``audit(fm)`` lists every finding whose claims are missing or do not hold. The
test suite audits every map it makes (``tests/conftest.py``). A sentence with no predicate here cannot
be written into a finding's claims: the vocabulary of what gradprobe can say is this module.
"""

from __future__ import annotations

import math
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
def compile_failed(fm: FlowMap, variant: str, frame: str, file: str, line: int, fail_type: str) -> bool:
    """Dynamo recorded a failed compile of that frame of the path (in its build or a run), of that type."""
    d = (fm.evidence.get("dynamo") or {}).get(variant) or {}
    windows = [d.get("build") or {}, *(d.get("runs") or {}).values()]
    return any(
        c.get("ok") is False and c.get("frame") == frame and _same_file(c.get("file"), file)
        and c.get("line") == line and c.get("fail_type") == fail_type
        for w in windows for c in w.get("compiles") or ()
    )  # fmt: skip


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
def error_frame(
    fm: FlowMap, variant: str, scenario: str | None, function: str, file: str | None = None
) -> bool:
    """The recorded traceback of that run's (or the build's) error passes through ``function`` (of a
    file of that name, where ``file`` is given)."""
    error = _error_of(fm, variant, scenario)
    return error is not None and any(
        f.rpartition(" in ")[2] == function and (file is None or f.partition(":")[0] == file)
        for f in error.frames or ()
    )


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


def _grad_calls(fm: FlowMap, variant: str, scenarios: list[str] | None) -> list[list[dict[str, Any]]]:
    """Per window (those runs, or every window of the path), the ``autograd.grad(create_graph=True)``
    calls dynamo's watch recorded (``evidence.grad_calls``)."""
    d = (fm.evidence.get("dynamo") or {}).get(variant) or {}
    runs = d.get("runs") or {}
    if scenarios is None:
        return [w.get("grad_calls") or [] for w in runs.values()]
    return [(runs.get(s) or {}).get("grad_calls") or [] for s in scenarios]


@_predicate
def grad_call(
    fm: FlowMap, variant: str, file: str, line: int, graph: bool, scenarios: list[str] | None = None
) -> bool:
    """In each of those runs of the path (or in one of its windows, ``scenarios`` None), an
    ``autograd.grad(create_graph=True)`` at that line, with grad mode on and its outputs carrying a graph,
    returned a result that carried one (``graph``) or none (and was not all None or zeros)."""

    def hit(c: Mapping[str, Any]) -> bool:
        return (
            _same_file(c.get("file"), file)
            and c.get("line") == line
            and bool(c.get("grad_enabled"))
            and bool(c.get("outputs_graph"))
            and bool(c.get("result_graph")) == graph
            and (graph or bool(c.get("result_nonzero")))
        )

    windows = _grad_calls(fm, variant, scenarios)
    found = [any(hit(c) for c in w) for w in windows]
    return bool(found) and (all(found) if scenarios is not None else any(found))


@_predicate
def traced_backward(
    fm: FlowMap, variant: str, scenario: str, file: str, line: int, grad_off: bool = True
) -> bool:
    """Behind a create_graph call of that run whose result carried no graph, the autograd graph passes
    through a custom ``autograd.Function`` applied at that line that torch.compile traced, its traced
    backward switching grad mode off (``grad_off``) or not."""
    return any(
        _same_file((t.get("applied_at") or {}).get("file"), file)
        and (t.get("applied_at") or {}).get("line") == line
        and bool(t.get("grad_off")) == grad_off
        for c in _grad_calls(fm, variant, [scenario])[0]
        if not c.get("result_graph")
        for t in c.get("traced_functions") or ()
    )


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


@_predicate
def same_counts(fm: FlowMap, variant: str, scenarios: list[str]) -> bool:
    """In those runs the path reaches as many parameters as the reference."""
    return bool(scenarios) and all(
        fm.run(variant, s).error is None and fm.count(variant, s) == fm.count(fm.reference, s)
        for s in scenarios
    )


@_predicate
def beyond(
    fm: FlowMap, variant: str, scenario: str, parameter: str, rtol: float, at_least: float = 0.0
) -> bool:
    """That cell's relative L1 error against the reference's gradient is above ``rtol`` (and at least
    ``at_least``); a cell the table calls missing or extra is beyond any tolerance."""
    c = fm.cell(variant, scenario, parameter)
    if c.verdict in ("missing", "extra"):
        return True
    e = c.rel_error
    return e is not None and (e != e or (e > rtol and e >= at_least * 0.999))


@_predicate
def term_gap(fm: FlowMap, variant: str, scenario: str, term: str, at_least: float) -> bool:
    """That run's value of ``term`` differs from the reference's by at least ``at_least`` of it."""
    a = fm.run(variant, scenario).term_values[term]
    r = fm.run(fm.reference, scenario).term_values[term]
    if a is None or r is None:
        return False
    gap = abs(a - r) / abs(r) if r else (0.0 if a == r else math.inf)
    return gap != gap or gap >= at_least * 0.999


@_predicate
def total_value(fm: FlowMap, variant: str, scenario: str, finite: bool) -> bool:
    """That run's total loss is (not) finite."""
    value = fm.run(variant, scenario).total
    return value is not None and math.isfinite(value) == finite


@_predicate
def finite_grads(fm: FlowMap, variant: str, scenarios: list[str]) -> bool:
    """Those runs measured gradients, none of them NaN or Inf."""
    return bool(scenarios) and all(
        fm.cells_of(variant, s) and not fm.with_status(variant, s, "nan", "inf") for s in scenarios
    )


def _ratio_is(pairs: Iterable[tuple[Any, Any]], factor: float, tol: float = 1e-6) -> bool:
    pairs = list(pairs)
    return bool(pairs) and all(
        a is not None
        and b
        and math.isfinite(a)
        and math.isfinite(b)
        and abs(a / b - factor) <= tol * abs(factor)
        for a, b in pairs
    )


@_predicate
def term_ratio(fm: FlowMap, variant: str, term: str, scenarios: list[str], factor: float) -> bool:
    """In those runs the path's value of ``term`` is ``factor`` times the reference's."""
    return _ratio_is(
        (
            (fm.run(variant, s).term_values.get(term), fm.run(fm.reference, s).term_values.get(term))
            for s in scenarios
        ),
        factor,
    )


@_predicate
def metric_ratio(fm: FlowMap, variant: str, metric: str, scenarios: list[str], factor: float) -> bool:
    """In those runs the metric the step reports is ``factor`` times the reference's."""
    return _ratio_is(
        (
            (fm.run(variant, s).metrics.get(metric), fm.run(fm.reference, s).metrics.get(metric))
            for s in scenarios
        ),
        factor,
    )


@_predicate
def grad_ratio(fm: FlowMap, variant: str, scenario: str, cosine: float, scale: float) -> bool:
    """That run's gradient vector has at least that cosine with the reference's, and that norm ratio."""
    run = fm.run(variant, scenario)
    got_cos, got_scale = run.grad_cosine, run.grad_scale
    return (
        got_cos is not None
        and got_scale is not None
        and got_cos >= cosine - 1e-12
        and abs(got_scale - scale) <= 1e-9 * abs(scale)
    )


@_predicate
def none_depend(fm: FlowMap, variant: str, terms: list[str], parameters: list[str]) -> bool:
    """The recorded lineage says no value of ``terms`` depends on any of ``parameters`` in that path."""
    recorded = _lineage(fm, variant)["terms"]
    return bool(terms) and not any(set(parameters) & set(recorded[t].get("depends_on") or ()) for t in terms)


@_predicate
def depends_on_nothing(fm: FlowMap, variant: str, term: str) -> bool:
    """The recorded lineage says ``term``'s value depends on no parameter in that path."""
    return _lineage(fm, variant)["terms"][term].get("depends_on") == []


@_predicate
def located(fm: FlowMap, kind: str, op: str, file: str, line: int) -> bool:
    """The locator recorded a break of ``kind`` at that op and line (``fm.breaks``)."""
    return any(
        b.get("kind") == kind
        and str(b.get("op")) == op
        and _same_file(b.get("file"), file)
        and b.get("line") == line
        for b in fm.breaks
    )


@_predicate
def bisect_fixed(fm: FlowMap, variant: str, fix: str) -> bool:
    """The bisection of that path measured ``fix`` matching the reference."""
    b = fm.bisection(variant) or {}
    f = b.get("fix") or {}
    return (
        f.get("variant") == fix
        and bool(f.get("ok"))
        and any(t.get("variant") == fix and t.get("ok") for t in b.get("trials") or ())
    )


def _physics(fm: FlowMap, variant: str) -> Mapping[str, Any]:
    if variant == fm.reference and fm.checks.get("physics"):
        return fm.checks["physics"]
    return fm.checks["physics_paths"][variant]


@_predicate
def physics_off(
    fm: FlowMap, variant: str, force_off: float, residual: float, cut: bool | None = None
) -> bool:
    """The physics check of that path failed: forces off -dE/dx by at least ``force_off`` of their
    scale, a sum rule residual of at least ``residual``; with ``cut``, the lineage of the energy's
    dependence on the coordinates was recorded and has (True) or has not (False) a cut."""
    p = _physics(fm, variant)
    return (
        not p.get("passed", True)
        and float(p["force"]["max_rel_error"]) >= force_off * 0.999
        and float(p["sum_rule"]["max_residual"]) >= residual * 0.999
        and (cut is None or ("cuts" in p and bool(p["cuts"]) == cut))
    )


def _balance(fm: FlowMap) -> Mapping[str, Any]:
    b = fm.checks["balance"]
    if b.get("error"):
        raise ValueError("the balance check did not run")
    return b


@_predicate
def dominated(fm: FlowMap, term: str, group: str, share: float) -> bool:
    """The balance check found ``term`` at most ``share`` of the gradient in every group it reaches
    (``group`` its best)."""
    return any(
        d["term"] == term and d["group"] == group and d["share"] <= share * 1.001
        for d in _balance(fm)["dominated"]
    )


@_predicate
def conflict(fm: FlowMap, terms: list[str], cosine: float, derived: list[bool] | None = None) -> bool:
    """The balance check measured the gradients of ``terms`` at that cosine or below (and whether each
    is computed from a gradient taken inside the step, ``derived``)."""
    return any(
        list(c["terms"]) == list(terms)
        and c["cosine"] <= cosine + 1e-12
        and (derived is None or list(c.get("derived") or ()) == list(derived))
        for c in _balance(fm)["conflicts"]
    )


@_predicate
def trained(fm: FlowMap, variant: str, term: str, verdict: str) -> bool:
    """The training check's verdict on ``term`` in that path."""
    return fm.checks["training"]["verdicts"][variant][term] == verdict


@_predicate
def optimizer_gap(fm: FlowMap, key: str, parameters: list[str]) -> bool:
    """The balance check's optimizer plan lists ``parameters`` under ``key`` (``not_in_optimizer``,
    ``zero_lr``)."""
    return _sub(parameters, (_balance(fm)["optimizer"] or {})[key] or ()) and bool(parameters)


@_predicate
def frozen_needed(fm: FlowMap, term: str, parameters: list[str]) -> bool:
    """The balance check found ``term`` would reach those frozen parameters."""
    return bool(parameters) and _sub(parameters, (_balance(fm).get("frozen") or {})[term])


@_predicate
def clipped(fm: FlowMap, term: str, relative_update: float) -> bool:
    """The balance check's clipping leaves ``term`` at most that fraction of its update alone."""
    return _balance(fm)["clipping"]["terms"][term]["relative_update"] <= relative_update * 1.001


@_predicate
def expected(fm: FlowMap, scenario: str, kind: str, declared: list[str]) -> bool:
    """The spec declares (``expect=``) that ``scenario`` ``reaches`` / ``not_reaches`` ``declared``."""
    return list(fm.expect[scenario][kind]) == list(declared)


def _distributed(fm: FlowMap) -> Mapping[str, Any]:
    d = fm.checks["distributed"]
    if not isinstance(d, Mapping):
        raise ValueError("not a map merged over ranks")
    return d


@_predicate
def rank_reach(
    fm: FlowMap,
    scenario: str,
    parameter: str,
    reached_on: list[int],
    no_path_on: list[int] = (),  # type: ignore[assignment]
) -> bool:
    """In ``scenario`` exactly the ranks ``reached_on`` reach ``parameter``; ``no_path_on`` of the others
    have no autograd path to it."""
    d = _distributed(fm)
    got = sorted((d.get("ranks") or {})[scenario].get(parameter) or ())
    no_path = (d.get("no_path") or {}).get(scenario) or {}
    return got == sorted(reached_on) and _sub(no_path_on, no_path.get(parameter) or ())


@_predicate
def unreached_on_every_rank(fm: FlowMap, parameters: list[str], no_path: bool = False) -> bool:
    """No rank reaches ``parameters`` in any scenario (and, ``no_path``, none has an autograd path)."""
    d = _distributed(fm)
    ranks, paths, world = d.get("ranks") or {}, d.get("no_path") or {}, int(d.get("world_size", 1))
    return (
        bool(parameters)
        and bool(ranks)
        and all(not ranks[s].get(p) for s in ranks for p in parameters)
        and (
            not no_path
            or all(len((paths.get(s) or {}).get(p) or ()) == world for s in ranks for p in parameters)
        )
    )


@_predicate
def wrapper(fm: FlowMap, wrapper: str, setting: str | None = None, value: Any = None) -> bool:
    """The ranks ran under that wrapper (``ddp``, ``fsdp2``, ``none``), with ``setting`` at ``value``."""
    d = _distributed(fm)
    return str(d.get("wrapper", "none")) == wrapper and (setting is None or d.get(setting) == value)


@_predicate
def diverged(fm: FlowMap, parameters: list[str], ranks: list[int], at_least: float) -> bool:
    """The checksums of ``parameters`` differ from rank 0's on ``ranks``, by at least ``at_least``."""
    off = (_distributed(fm).get("divergence") or {}).get("parameters") or {}
    return (
        bool(parameters)
        and all(p in off for p in parameters)
        and _sub(ranks, {r for p in parameters for r in off[p].get("ranks", ())})
        and max(float(off[p].get("max_rel_diff", 0.0)) for p in parameters) >= at_least * 0.999
    )


@_predicate
def counts(fm: FlowMap, variant: str, scenario: str, reached: int, reference: int) -> bool:
    """That run reaches ``reached`` trainable parameters, the reference's run of it ``reference``."""
    return count(fm, variant, scenario, reached) and count(fm, fm.reference, scenario, reference)


@_predicate
def scaled_cells(fm: FlowMap, variant: str, scenario: str, factor: float, tol: float) -> bool:
    """In that run every parameter the reference reaches is reached, with a gradient ``factor`` times
    the reference's: its relative error is ``|factor - 1|`` within ``tol``."""
    cells, ref = fm.cells_of(variant, scenario), fm.reached(fm.reference, scenario)
    want = abs(factor - 1.0)
    return bool(ref) and all(
        p in cells
        and cells[p].verdict in ("match", "wrong")
        and cells[p].rel_error is not None
        and abs(cells[p].rel_error - want) <= tol
        for p in ref
    )


# ----- predicates of a trainer's own checks (DeePMD: its metrics recomputed, its two backends) ----------


@_predicate
def metric_recomputed(
    fm: FlowMap, check: str, path: str, metric: str, factor: float, natoms: int | None = None
) -> bool:
    """In that check the metric ``path`` reports is ``factor`` times gradprobe's recomputation of it by
    the documented definition, beyond the check's tolerance (and the batch had ``natoms`` atoms)."""
    result = fm.checks[check]
    metrics = result["metrics"] if check == "backends" else result
    row = metrics["paths"][path][metric]
    if natoms is not None and metrics.get("natoms") != natoms:
        return False
    got, want = float(row["reported"]), float(row["recomputed"])
    return (
        not row["passed"]
        and want != 0.0
        and abs(got - want) > float(metrics["rtol"]) * max(abs(got), abs(want))
        and abs(got / want - factor) <= 1e-6 * abs(factor)
    )


def _backends(fm: FlowMap) -> Mapping[str, Any]:
    return fm.checks["backends"]


@_predicate
def backend_output(fm: FlowMap, output: str, at_least: float) -> bool:
    """The other backend's ``output`` (energy, force, virial) differs from the reference backend's on the
    same weights and batch by at least that (relative to its scale)."""
    return not float(_backends(fm)["outputs"][output]) <= at_least * 0.999


@_predicate
def backend_grad(fm: FlowMap, term: str, variable: str, at_least: float) -> bool:
    """The gradient of ``term`` along that serialized variable differs between the backends by at least
    that (relative to the variable's gradient, floored at a millionth of the term's largest)."""
    return not float(_backends(fm)["grads"][term]["variables"][variable]) <= at_least * 0.999


@_predicate
def backend_unmatched(fm: FlowMap, variables: list[str]) -> bool:
    """Those serialized variables are trainable in one backend only."""
    return bool(variables) and _sub(variables, _backends(fm).get("unmatched") or ())
