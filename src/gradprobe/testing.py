"""Assertions and snapshots for keeping a gradient flow fixed in a test suite.

>>> fm = gradprobe.probe(spec, variants="eager,make_fx[detach=alias]+compile:aot_eager")  # doctest: +SKIP
>>> assert_grad_flow(fm, reaches={"force only": ["fitting."]})                             # doctest: +SKIP

The pytest plugin (installed with gradprobe) adds the ``gradprobe_snapshot`` fixture, which stores a
flow map as JSON next to the test and compares later runs with it (``--gradprobe-update`` rewrites).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .declarations import unmet
from .flowmap import FlowMap
from .report.controls import visible
from .spec import ProbeSpec

NORM_RTOL = 1e-6  # norms may drift by this much between runs and machines without counting as a change


def grad_flow_problems(
    fm: FlowMap,
    *,
    reaches: Mapping[str, Iterable[str]] | None = None,
    not_reaches: Mapping[str, Iterable[str]] | None = None,
    allow: Iterable[str] = (),
    fail_on: str = "error",
) -> list[str]:
    """Everything wrong with a flow map, one line each (empty when the flow is healthy). ``fail_on=
    "warning"``: warnings count too (an intended stop-gradient then needs its line in the spec's notes)."""
    allow = set(allow)
    failing = ("error", "warning") if fail_on == "warning" else ("error",)
    problems = [
        f"{f.cause}: {f.message}" for f in fm.findings if f.severity in failing and f.cause not in allow
    ]
    for v in fm.variant_names:
        for s in fm.scenario_names:
            run = fm.run(v, s)
            if run.error is not None and not any(f.cause in allow for f in fm.findings):
                problems.append(f"{s} in {v}: run failed at {run.error.stage}: {run.error.message}")
                continue
            for p, c in fm.differences(v, s).items():
                problems.append(f"{s} in {v}: {p} is {c.verdict} against {fm.reference} (status {c.status}, "
                                f"rel. error {c.rel_error:.3g})")  # fmt: skip
    declared = {
        s: {"reaches": list((reaches or {}).get(s, ())), "not_reaches": list((not_reaches or {}).get(s, ()))}
        for s in [*(reaches or {}), *(not_reaches or {})]
    }
    problems += [
        f"expected flow for the scenario {s!r}, which the flow map does not have (its scenarios: "
        f"{', '.join(fm.scenario_names)})"
        for s in declared if s not in fm.scenario_names
    ]  # fmt: skip
    # The same evaluation as a spec's expect= (declarations.unmet); those already are error findings.
    problems += [u.text() for u in unmet(fm, declared)]
    return problems


def assert_grad_flow(
    target: FlowMap | ProbeSpec,
    *,
    variants: str | Sequence[str] | None = None,
    checks: Sequence[str] = (),
    reaches: Mapping[str, Iterable[str]] | None = None,
    not_reaches: Mapping[str, Iterable[str]] | None = None,
    allow: Iterable[str] = (),
    fail_on: str = "error",
) -> FlowMap:
    """Fail, saying which term, which parameters, which variants and what changed, unless the flow is
    healthy: no error-severity finding (``fail_on="warning"``: no warning either; causes in ``allow``
    excepted), every variant matching the
    reference in reach and value, and the ``reaches`` / ``not_reaches`` expectations met (parameter
    names or module prefixes per scenario). A spec is probed first. Returns the flow map."""
    __tracebackhide__ = True
    if isinstance(target, ProbeSpec):
        from .probe import probe

        target = probe(target, variants=variants, checks=checks, progress=False)  # a test stays quiet
    problems = grad_flow_problems(
        target, reaches=reaches, not_reaches=not_reaches, allow=allow, fail_on=fail_on
    )
    if problems:
        shown = problems[:20] + ([f"… and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise AssertionError(visible("gradient flow broken:\n  " + "\n  ".join(shown)))
    return target


def flow_changes(old: FlowMap, new: FlowMap, *, norm_rtol: float = NORM_RTOL) -> list[str]:
    """What changed between two flow maps, ignoring what legitimately varies: timings, versions, and
    norms within ``norm_rtol``. ``none`` vs ``zero`` is not a change (flows are judged on non-zero)."""
    changes = []
    if old.variant_names != new.variant_names or old.scenario_names != new.scenario_names:
        changes.append(f"variants/scenarios changed: {old.variant_names}/{old.scenario_names} → "
                       f"{new.variant_names}/{new.scenario_names}")  # fmt: skip
    for v in sorted(set(old.variant_names) & set(new.variant_names)):
        for s in sorted(set(old.scenario_names) & set(new.scenario_names)):
            a, b = old.run(v, s).error, new.run(v, s).error
            if (a is None) != (b is None) or (a and b and a.type != b.type):
                changes.append(
                    f"{s} in {v}: run {'error ' + a.type if a else 'ok'} → {'error ' + b.type if b else 'ok'}"
                )
                continue
            ca, cb = old.cells_of(v, s), new.cells_of(v, s)
            for p in sorted(set(ca) | set(cb)):
                x, y = ca.get(p), cb.get(p)
                if x is None or y is None:
                    changes.append(f"{s} in {v}: parameter {p} {'added' if x is None else 'removed'}")
                elif _flow_status(x.status) != _flow_status(y.status):
                    changes.append(f"{s} in {v}: {p} {x.status} → {y.status}")
                elif x.verdict != y.verdict:
                    changes.append(f"{s} in {v}: {p} verdict {x.verdict} → {y.verdict}")
                elif not _close(x.norm, y.norm, norm_rtol):
                    changes.append(f"{s} in {v}: {p} norm {x.norm or 0.0:.6g} → {y.norm or 0.0:.6g}")
    old_errors = sorted(f.cause for f in old.findings if f.severity == "error")
    new_errors = sorted(f.cause for f in new.findings if f.severity == "error")
    if old_errors != new_errors:
        changes.append(f"error findings {old_errors} → {new_errors}")
    return changes


def _flow_status(status: str) -> str:
    """none and zero are the same flow (how a term was isolated decides which one shows)."""
    return "none" if status == "zero" else status


def _close(a: float | None, b: float | None, rtol: float) -> bool:
    a, b = a or 0.0, b or 0.0  # no gradient and a zero gradient have the same (zero) norm
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= rtol * max(abs(a), abs(b)) or a == b


class Snapshot:
    """A flow map stored as JSON; ``match(fm)`` compares with it (or rewrites it when updating)."""

    def __init__(self, path: Path, update: bool = False) -> None:
        self.path = Path(path)
        self.update = update

    def match(self, fm: FlowMap) -> None:
        __tracebackhide__ = True
        if self.update:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fm.to_json(self.path)
            return
        if not self.path.exists():
            raise AssertionError(
                f"no gradprobe snapshot at {self.path}: run pytest with --gradprobe-update to create it"
            )
        old = FlowMap.from_json(self.path)
        changes = flow_changes(old, fm)
        if changes:
            shown = changes[:20] + ([f"… and {len(changes) - 20} more"] if len(changes) > 20 else [])
            what = "gradient flow differs from"
            hint = "\n(if the change is intended, rerun with --gradprobe-update to rewrite the snapshot)"
            if not flow_changes(old, fm, norm_rtol=math.inf):
                what = "gradient norms differ from"
                hint = (
                    "\nThe flow is the same (every status, verdict, run error and error finding matches); "
                    "only norms moved. Other initial weights or data give this: a model built outside the "
                    "spec without a fixed seed (a factory passed as spec.model is seeded by spec.seed), a "
                    "batch drawn from an unseeded RNG, or another torch/BLAS version." + hint
                )
            raise AssertionError(
                visible(
                    f"{what} the snapshot {self.path.name} ({len(changes)} change(s)):\n  "
                    + "\n  ".join(shown)
                    + hint
                )
            )


def assertrepr_compare(left: Any, right: Any) -> list[str] | None:
    """Lines pytest shows for ``flow_map_a == flow_map_b``: a summary, then only what differs."""
    if not (isinstance(left, FlowMap) and isinstance(right, FlowMap)):
        return None
    changes = flow_changes(left, right, norm_rtol=0.0)
    same = len(left.cells) - len(changes)
    lines = [f"flow maps differ in {len(changes)} place(s)"]
    lines += changes[:30]
    if same > 0:
        lines.append(f"({same} identical cells omitted)")
    return lines


__all__ = ["Snapshot", "assert_grad_flow", "flow_changes", "grad_flow_problems"]
