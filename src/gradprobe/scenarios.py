"""Scenarios: which terms are switched on for one measurement."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .errors import SpecError, did_you_mean

ALL = "all"


@dataclass(frozen=True)
class Scenario:
    """One measurement's set of switched-on terms (each with weight 1, the others 0)."""

    name: str
    terms: tuple[str, ...]


def default_scenarios(terms: Sequence[str]) -> tuple[Scenario, ...]:
    """Each term alone (``"energy only"``), then all together (``"all"``)."""
    return _defaults(tuple(terms))


@functools.lru_cache(maxsize=64)
def _defaults(terms: tuple[str, ...]) -> tuple[Scenario, ...]:
    # Made once per set of term names (a probe asks twice; repeated probes of a model, each time):
    # the scenarios are frozen, so the same ones serve every caller.
    alone = tuple(Scenario(f"{t} only", (t,)) for t in terms)
    return (*alone, Scenario(ALL, tuple(terms))) if len(terms) > 1 else alone


def resolve_scenarios(
    given: Mapping[str, Sequence[str]] | Sequence[Scenario] | None, terms: Sequence[str]
) -> tuple[Scenario, ...]:
    """The spec's scenarios, validated against the term names; the defaults when none are given."""
    if given is None:
        return default_scenarios(terms)
    if isinstance(given, Mapping):
        scenarios = tuple(Scenario(str(name), _as_terms(name, ts)) for name, ts in given.items())
    else:
        scenarios = tuple(given)
    if not scenarios:
        raise SpecError("scenarios is empty: give at least one, or leave it out for the defaults")
    seen: set[str] = set()
    for sc in scenarios:
        if not isinstance(sc, Scenario):
            raise SpecError(f"scenarios must be Scenario objects or a mapping name -> terms, got {sc!r}")
        if sc.name in seen:
            raise SpecError(f"scenario name {sc.name!r} is used twice")
        seen.add(sc.name)
        if not sc.terms:
            raise SpecError(f"scenario {sc.name!r} switches on no term")
        for t in sc.terms:
            if t not in terms:
                raise SpecError(
                    f"scenario {sc.name!r} names unknown term {t!r}{did_you_mean(t, terms)}; "
                    f"terms are: {', '.join(terms)}"
                )
    return scenarios


def _as_terms(name: object, ts: object) -> tuple[str, ...]:
    if isinstance(ts, str):
        return (ts,)
    if not isinstance(ts, Sequence):
        raise SpecError(f"scenario {name!r}: expected a list of term names, got {type(ts).__name__}")
    return tuple(str(t) for t in ts)
