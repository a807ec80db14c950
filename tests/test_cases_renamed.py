"""The cases again under random names (terms, batch keys, submodules, variants): the diagnosis must not
lean on names. Same error causes, same lines and graph nodes as with the default names."""

from __future__ import annotations

import functools

import pytest
from cases import Case, Names, all_cases
from test_cases import errors, main_finding, probe, summary

import gradprobe

pytestmark = pytest.mark.slow

CASES = all_cases()
SEEDS = (0, 1)


@functools.cache
def _default(case_id: str) -> gradprobe.FlowMap:
    case = next(c for c in CASES if c.id == case_id)
    return probe(case.build(Names()))


def _place(fm: gradprobe.FlowMap, case: Case) -> tuple:
    """(line, whether the node has the case's prefix) of the main finding; () when there is none."""
    if not case.is_bug or not errors(fm) & case.expect:
        return ()
    loc = main_finding(fm, case).location or {}
    node = str(loc.get("node", ""))
    return (loc.get("line"), node.startswith(case.node) if case.node else None)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_renamed(case: Case, seed: int) -> None:
    setup = case.build(Names.random(seed))
    spec_terms = list(setup.spec.terms or ())
    fm = probe(setup)
    base = _default(case.id)

    # Renaming took effect: the flow map's terms, parameters and user variants carry the random names.
    assert set(fm.terms) == set(spec_terms)
    assert not set(fm.terms) & set(base.terms)
    assert not {p.name for p in fm.parameters} & {p.name for p in base.parameters}
    user = [v.name for v in fm.variants if v.name != fm.reference]
    assert all(v not in base.variant_names for v in user)

    # The diagnosis did not change.
    assert errors(fm) == errors(base), summary(fm)
    if case.is_bug:
        assert _place(fm, case) == _place(base, case), (summary(fm), summary(base))
        assert _place(fm, case), summary(fm)
        if case.node:
            assert _place(fm, case)[1], summary(fm)
