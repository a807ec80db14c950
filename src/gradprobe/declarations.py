"""What the user declares about the flow: one mechanism for ``notes`` and ``expect``.

* ``notes={prefix: why}``: parameters that may get no gradient, by design (an auxiliary head, a constant
  per-type energy, an intended cut). Reports show the reason; causes turn errors into information.
* ``expect={scenario: [prefix, ...]}``: parameters the scenario must reach (a non-zero gradient), or
  ``{scenario: {"reaches": [...], "not_reaches": [...]}}`` for both directions. A declaration that the
  measured flow breaks is an error finding (``expectation-unmet``) with the place the gradient stops.

``assert_grad_flow(reaches=..., not_reaches=...)`` reads its expectations through the same functions.
A prefix matches a parameter's full name or any name below it (``fitting`` matches ``fitting.out.bias``;
a trailing dot is allowed).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import SpecError, did_you_mean

KINDS = ("reaches", "not_reaches")


def matches(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p.rstrip(".") + ".") for p in prefixes)


def note_for(parameter: str, notes: Mapping[str, str]) -> str | None:
    """The note of the longest prefix that covers ``parameter``, if any."""
    if parameter in notes:
        return notes[parameter]
    best = max((p for p in notes if parameter.startswith(p.rstrip(".") + ".")), key=len, default=None)
    return notes[best] if best is not None else None


def normalized_expect(expect: Any) -> dict[str, dict[str, list[str]]]:
    """``{scenario: {"reaches": [...], "not_reaches": [...]}}`` from either accepted form; a wrong
    shape is a SpecError that shows the right one."""
    example = '{"force only": ["fitting."]} or {"force only": {"reaches": [...], "not_reaches": [...]}}'
    if expect is None:
        return {}
    if not isinstance(expect, Mapping):
        raise SpecError(f"expect must be a mapping {{scenario: [parameter prefix, ...]}}, got {expect!r}; "
                        f"e.g. expect={example}")  # fmt: skip
    out: dict[str, dict[str, list[str]]] = {}
    for scenario, what in expect.items():
        if not isinstance(scenario, str):
            raise SpecError(f"expect's keys are scenario names, got {scenario!r}; e.g. expect={example}")
        if isinstance(what, str) or not isinstance(what, Mapping | Sequence):
            raise SpecError(
                f"expect[{scenario!r}] must be a list of parameter prefixes or a mapping with 'reaches' "
                f"and/or 'not_reaches', got {what!r}; e.g. expect={example}"
            )
        parts = dict(what) if isinstance(what, Mapping) else {"reaches": list(what)}
        unknown = [k for k in parts if k not in KINDS]
        if unknown:
            raise SpecError(
                f"expect[{scenario!r}] has {unknown[0]!r}; its keys are 'reaches' and 'not_reaches'"
            )
        entry = {}
        for kind in KINDS:
            prefixes = parts.get(kind, [])
            if isinstance(prefixes, str) or not all(isinstance(p, str) and p for p in prefixes):
                raise SpecError(
                    f"expect[{scenario!r}][{kind!r}] must be a list of parameter names or prefixes, got "
                    f"{prefixes!r} (write [{prefixes!r}] for one)"
                )
            entry[kind] = list(prefixes)
        out[scenario] = entry
    return out


def check_against(
    expect: Mapping[str, Mapping[str, Sequence[str]]], scenarios: Sequence[str], parameters: Sequence[str]
) -> None:
    """Every declared scenario exists and every prefix names a trainable parameter (a misspelt
    declaration would otherwise pass silently)."""
    for scenario, entry in expect.items():
        if scenario not in scenarios:
            raise SpecError(
                f"expect names the scenario {scenario!r}{did_you_mean(scenario, scenarios)}; the scenarios "
                f"are: {', '.join(scenarios)}"
            )
        for kind in KINDS:
            for prefix in entry.get(kind, []):
                if not any(matches(p, [prefix]) for p in parameters):
                    raise SpecError(
                        f"expect[{scenario!r}][{kind!r}] names {prefix!r}, which matches no trainable "
                        f"parameter{did_you_mean(prefix, parameters)} (give a parameter name or a module "
                        "prefix such as 'fitting')"
                    )


@dataclass(frozen=True)
class Unmet:
    """One broken expectation on one measured run."""

    variant: str
    scenario: str
    kind: str  # reaches | not_reaches
    parameters: tuple[str, ...]  # lost (reaches) or reached against the declaration (not_reaches)
    statuses: tuple[str, ...]

    def text(self) -> str:
        shown = ", ".join(self.parameters)
        if self.kind == "reaches":
            return f"{self.scenario} in {self.variant}: expected to reach {shown}, but it does not"
        return f"{self.scenario} in {self.variant}: expected not to reach {shown}, but it does"


def unmet(fm: Any, expect: Mapping[str, Mapping[str, Sequence[str]]]) -> list[Unmet]:
    """Each declaration the measured flow breaks, per variant whose run did not fail (a failed run
    measured nothing: it is a finding of its own)."""
    out = []
    for scenario, entry in expect.items():
        if scenario not in fm.scenario_names:
            continue
        for v in fm.variant_names:
            if fm.run(v, scenario).error is not None:
                continue
            got = fm.reached(v, scenario)
            cells = fm.cells_of(v, scenario)
            lost = [p for p in fm.trainable if matches(p, entry.get("reaches", ())) and p not in got]
            if lost:
                out.append(Unmet(v, scenario, "reaches", tuple(lost), tuple(_status(cells, p) for p in lost)))
            extra = sorted(p for p in got if matches(p, entry.get("not_reaches", ())))
            if extra:
                out.append(
                    Unmet(v, scenario, "not_reaches", tuple(extra), tuple(_status(cells, p) for p in extra))
                )
    return out


def _status(cells: Mapping[str, Any], p: str) -> str:
    c = cells.get(p)
    return c.status if c is not None else "none"
