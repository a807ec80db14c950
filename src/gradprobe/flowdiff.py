"""Compare two saved flow maps (before/after a torch upgrade, a refactor, a fix): what changed in the flow.

A *flow change* is one of: a cell whose status moved between "not reached" (``none`` or ``zero``, which
depend only on how a term was isolated, see docs/flowmap-schema.md) and ``nonzero``/``nan``/``inf``; a
verdict against the reference that changed; a run that started or stopped failing; a variant, scenario or
parameter added or removed; an error-severity finding added or removed; another reference variant. Norms
that moved by more than a relative tolerance are reported as information only: they are no flow change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .flowmap import Cell, FlowMap, Run, RunError
from .report.controls import visible
from .status import NONE, ZERO

NOT_REACHED = "not reached"  # none and zero, which are the same flow


@dataclass(frozen=True, slots=True)
class CellChange:
    """One (variant, scenario, parameter) whose status or verdict changed; both runs ran."""

    variant: str
    scenario: str
    parameter: str
    status_before: str
    status_after: str
    verdict_before: str | None
    verdict_after: str | None

    @property
    def flow_changed(self) -> bool:
        return flow_class(self.status_before) != flow_class(self.status_after)

    @property
    def verdict_changed(self) -> bool:
        return self.verdict_before != self.verdict_after


@dataclass(frozen=True, slots=True)
class RunChange:
    """A (variant, scenario) run that started or stopped failing; ``reached`` is what the working
    side's run reached (before when it started failing, after when it stopped)."""

    variant: str
    scenario: str
    started_failing: bool
    error: RunError | None  # the failing side's error (None: no such run there)
    reached: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class NormChange:
    variant: str
    scenario: str
    parameter: str
    before: float
    after: float


@dataclass(frozen=True)
class FlowDiff:
    """Everything that differs between two flow maps ``a`` (before) and ``b`` (after)."""

    cells: tuple[CellChange, ...] = ()
    runs: tuple[RunChange, ...] = ()
    added: dict[str, tuple[str, ...]] | None = None  # "variants" | "scenarios" | "parameters" -> names
    removed: dict[str, tuple[str, ...]] | None = None
    findings_added: tuple[str, ...] = ()  # "cause: message" of error findings only in b
    findings_removed: tuple[str, ...] = ()
    reference: tuple[str, str] | None = None  # (before, after) when the reference variant changed
    norms: tuple[NormChange, ...] = ()  # information only
    norm_rtol: float | None = None

    @property
    def changed(self) -> bool:
        """True when the flow changed; norm changes alone never count."""
        return bool(
            self.cells
            or self.runs
            or any((self.added or {}).values())
            or any((self.removed or {}).values())
            or self.findings_added
            or self.findings_removed
            or self.reference
        )

    def render(self, limit: int = 200) -> str:
        """Plain text: a headline, then each kind of change, one line per changed cell or run."""
        return visible("\n".join(_render(self, limit)) + "\n")


def flow_class(status: str) -> str:
    """``none`` and ``zero`` are the same flow (not reached); other statuses stand for themselves."""
    return NOT_REACHED if status in (NONE, ZERO) else status


def diff_maps(a: FlowMap, b: FlowMap, *, norm_rtol: float | None = None) -> FlowDiff:
    """Compare ``a`` (before) with ``b`` (after). ``norm_rtol``: relative norm change reported as
    information (default: the larger of the maps' ``rtol``, else 1e-3); 0 or less turns it off."""
    if norm_rtol is None:
        norm_rtol = max((r for r in (a.rtol, b.rtol) if r is not None), default=1e-3)
    variants = [v for v in a.variant_names if v in b.variant_names]
    scenarios = [s for s in a.scenario_names if s in b.scenario_names]
    in_b = {q.name for q in b.parameters}
    params = [p.name for p in a.parameters if p.name in in_b]
    cells: list[CellChange] = []
    runs: list[RunChange] = []
    norms: list[NormChange] = []
    for v in variants:
        for s in scenarios:
            ra, rb = _run(a, v, s), _run(b, v, s)
            if _failed(ra) != _failed(rb):
                runs.append(_run_change(a, b, v, s, ra, rb))
                continue
            if _failed(ra):
                continue
            ca, cb = a.cells_of(v, s), b.cells_of(v, s)
            for p in params:
                x, y = ca.get(p), cb.get(p)
                if x is None or y is None:
                    continue
                if x.status != y.status or x.verdict != y.verdict:  # else: the same flow, cheaply
                    change = _cell_change(x, y)
                    if change is not None:
                        cells.append(change)
                        continue
                if norm_rtol > 0 and x.norm != y.norm and _norm_moved(x, y, norm_rtol):
                    norms.append(NormChange(v, s, p, x.norm, y.norm))  # type: ignore[arg-type]
    fa, fb = _error_findings(a), _error_findings(b)
    return FlowDiff(
        cells=tuple(cells),
        runs=tuple(runs),
        added=_names_diff(b, a),
        removed=_names_diff(a, b),
        findings_added=tuple(text for key, text in fb.items() if key not in fa),
        findings_removed=tuple(text for key, text in fa.items() if key not in fb),
        reference=(a.reference, b.reference) if a.reference != b.reference else None,
        norms=tuple(norms),
        norm_rtol=norm_rtol if norm_rtol > 0 else None,
    )


def _run(fm: FlowMap, variant: str, scenario: str) -> Run | None:
    try:
        return fm.run(variant, scenario)
    except KeyError:
        return None


def _failed(run: Run | None) -> bool:
    return run is None or run.error is not None


def _run_change(a: FlowMap, b: FlowMap, v: str, s: str, ra: Run | None, rb: Run | None) -> RunChange:
    started = _failed(rb)
    working, failing = (a, rb) if started else (b, ra)
    got = working.reached(v, s)
    reached = tuple(p for p in working.trainable if p in got)
    return RunChange(v, s, started, failing.error if failing else None, reached)


def _cell_change(ca: Cell, cb: Cell) -> CellChange | None:
    if flow_class(ca.status) == flow_class(cb.status) and ca.verdict == cb.verdict:
        return None
    return CellChange(ca.variant, ca.scenario, ca.parameter, ca.status, cb.status, ca.verdict, cb.verdict)


def _norm_moved(ca: Cell, cb: Cell, rtol: float) -> bool:
    x, y = ca.norm, cb.norm
    if x is None or y is None or not (math.isfinite(x) and math.isfinite(y)) or x == y:
        return False
    return abs(x - y) > rtol * max(abs(x), abs(y))


def _names_diff(x: FlowMap, y: FlowMap) -> dict[str, tuple[str, ...]]:
    """Variants, scenarios and parameters of ``x`` that ``y`` lacks."""
    x_params, y_params = [p.name for p in x.parameters], {p.name for p in y.parameters}
    return {
        "variants": tuple(v for v in x.variant_names if v not in y.variant_names),
        "scenarios": tuple(s for s in x.scenario_names if s not in y.scenario_names),
        "parameters": tuple(p for p in x_params if p not in y_params),
    }


def _error_findings(fm: FlowMap) -> dict[tuple[str, str], str]:
    """Error findings keyed by (cause, variant): messages carry numbers that may move with the norms."""
    return {
        (f.cause, str(f.evidence.get("variant", ""))): f"{f.cause}: {f.message}"
        for f in fm.findings
        if f.severity == "error"
    }


def _headline(d: FlowDiff) -> str:
    if not d.changed:
        return "flow unchanged"
    parts = [
        f"{len(d.cells)} cell(s)" if d.cells else "",
        f"{len(d.runs)} run(s)" if d.runs else "",
        f"{len(d.findings_added) + len(d.findings_removed)} error finding(s)"
        if d.findings_added or d.findings_removed
        else "",
    ]
    counted = ", ".join(p for p in parts if p)
    return "flow changed" + (f": {counted}" if counted else "")


def _render(d: FlowDiff, limit: int) -> list[str]:
    out = [_headline(d)]
    if d.reference:
        out.append(f"reference variant: {d.reference[0]} -> {d.reference[1]} (verdicts are not comparable)")
    for kind, group in (("added", d.added or {}), ("removed", d.removed or {})):
        out.extend(f"{what} {kind}: {', '.join(names)}" for what, names in group.items() if names)
    if d.runs:
        out.append("runs that started or stopped failing:")
        out.extend(line for r in d.runs for line in _run_lines(r))
    if d.cells:
        out.append("cells that changed (variant, scenario, parameter: before -> after):")
        out.extend(f"  {_cell_line(c)}" for c in d.cells[:limit])
        if len(d.cells) > limit:
            out.append(f"  … and {len(d.cells) - limit} more")
    out.extend(f"error finding added: {t}" for t in d.findings_added)
    out.extend(f"error finding removed: {t}" for t in d.findings_removed)
    if d.norms:
        out.append(
            f"info: {len(d.norms)} norm(s) moved by more than {d.norm_rtol:g} (relative; not a flow change):"
        )
        out.extend(
            f"  {n.variant}, {n.scenario}, {n.parameter}: {n.before:.6g} -> {n.after:.6g}"
            for n in d.norms[:limit]
        )
    return out


def _run_lines(r: RunChange) -> list[str]:
    err = f"at {r.error.stage}: {r.error.type}: {r.error.message}" if r.error else "(no such run)"
    reached = ", ".join(r.reached) or "nothing"
    if r.started_failing:
        return [f"  {r.variant}, {r.scenario}: started failing {err}", f"    reached before: {reached}"]
    return [
        f"  {r.variant}, {r.scenario}: stopped failing (was failing {err})",
        f"    now reaches: {reached}",
    ]


def _cell_line(c: CellChange) -> str:
    parts = []
    if c.status_before != c.status_after:
        parts.append(f"{c.status_before} -> {c.status_after}")
    if c.verdict_changed:
        parts.append(f"verdict {c.verdict_before or '-'} -> {c.verdict_after or '-'}")
    return f"{c.variant}, {c.scenario}, {c.parameter}: " + ", ".join(parts)
