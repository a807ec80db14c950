"""The cases of ``tests/cases``: small real training setups (not the zoo) with one known bug each, a
fixed twin per bug, and healthy setups. Each is probed with ``diagnose=True`` and the error causes,
and the place the main finding names, must match what the case declares."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from cases import FAMILIES, Case, Names, Setup, all_cases, marked_line, term_weights, user_run

import gradprobe

pytestmark = pytest.mark.slow

CASES = all_cases()
BY_ID = {c.id: c for c in CASES}
OPAQUE = ("opaque-compiled", "opaque-eager", "make_fx-replay")
# The term (base name) a term-located finding must name.
TERM_OF = {"pair-peratom-norm": "e_loss", "tagger-dead-lm": "lm"}
SPELLINGS = [("detach", "data"), ("no_grad", "inference_mode"), ("item", "float"), ("tolist", "numpy"), ("long", "int32")]  # fmt: skip
MECHANISMS = {
    "graph-break-in-model",
    "makefx-detach",
    "frozen-trace",
    "recompile-per-scenario",
    "trace-eval-mode",
    "norm-mismatch",
    "dead-term",
    "forces-not-conservative",
}


def probe(setup: Setup) -> gradprobe.FlowMap:
    return gradprobe.probe(
        setup.spec, variants=list(setup.variants), diagnose=True, checks=tuple(setup.checks)
    )


def errors(fm: gradprobe.FlowMap) -> set[str]:
    return {f.cause for f in fm.findings if f.severity == "error"}


def main_finding(fm: gradprobe.FlowMap, case: Case) -> gradprobe.Finding:
    return next(f for f in fm.findings if f.severity == "error" and f.cause in case.expect)


def summary(fm: gradprobe.FlowMap) -> str:
    return "\n".join(f"  {f.severity} {f.cause} {f.location}: {f.message[:200]}" for f in fm.findings)


def check_location(fm: gradprobe.FlowMap, case: Case, names: Names) -> None:
    """The main finding points where the case says (file and marked line, graph node, term)."""
    f = main_finding(fm, case)
    loc = f.location or {}
    if case.where is not None:
        assert loc.get("file") and os.path.basename(loc["file"]) == os.path.basename(case.file), loc
        assert loc.get("line") == marked_line(case.file, case.where), loc
    if case.node is not None:
        assert str(loc.get("node", "")).startswith(case.node), loc
    if case.id in TERM_OF:
        assert loc.get("term") == names.term(TERM_OF[case.id]), loc
    if f.cause == "norm-mismatch":
        assert loc.get("variant") in fm.variant_names and loc["variant"] != fm.reference, loc
    if f.cause == "recompile-per-scenario":
        assert f.evidence.get("guards"), f.evidence


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_truth(case: Case) -> None:
    """The bug is real (or fixed), by plain torch: no gradprobe involved."""
    if case.truth is None:
        pytest.skip("no ground truth")
    case.truth(Names())


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_probe(case: Case) -> None:
    names = Names()
    fm = probe(case.build(names))
    assert errors(fm) == set(case.expect), summary(fm)
    if case.is_bug:
        check_location(fm, case, names)
    else:
        # An explicit stop-gradient both twins keep (a straight-through estimator's detach()) is a
        # warning that asks (issue 32's policy); nothing else may be.
        noisy = [f for f in fm.findings if f.severity in ("error", "warning") and f.cause != "stop-gradient"]
        assert not noisy, summary(fm)


def test_the_set_meets_the_requirements() -> None:
    bugs = [c for c in CASES if c.is_bug]
    twins = [c for c in CASES if c.twin_of is not None]
    healthy = [c for c in CASES if c.healthy]
    assert len(bugs) >= 16
    assert len({c.family for c in bugs}) >= 4
    assert 2 * sum(c.container in OPAQUE for c in bugs) >= len(bugs)
    assert {c.family for c in CASES} <= set(FAMILIES)
    for c in CASES:
        assert os.path.basename(c.file) == f"{c.family}.py", c.id
        assert c.container in ("reference", *OPAQUE), c.id
        assert not (c.healthy and c.is_bug) and not (c.twin_of and (c.is_bug or c.healthy)), c.id

    # Every bug has exactly one twin: same family, mechanism and container, nothing expected.
    twin_of = Counter(t.twin_of for t in twins)
    for b in bugs:
        assert twin_of[b.id] == 1, b.id
    for t in twins:
        b = BY_ID[t.twin_of]  # type: ignore[index]
        assert b.is_bug and not t.expect and t.where is None and t.node is None
        assert (t.family, t.mechanism, t.container, t.file) == (b.family, b.mechanism, b.container, b.file)
    assert len(CASES) == 2 * len(bugs) + len(healthy)

    # Locations: a marker exists, once, for every case that expects a line; replays name a node or a line.
    for b in bugs:
        if b.where is not None:
            assert b.where == b.id
            marked_line(b.file, b.where)
        if b.container == "make_fx-replay":
            assert b.node is not None or b.where is not None, b.id
    assert {cause for b in bugs for cause in b.expect} >= MECHANISMS

    # Cuts: both spellings of each, and both opaque containers where the mechanism survives make_fx.
    cuts = [b for b in bugs if "graph-break-in-model" in b.expect]
    for pair in SPELLINGS:
        assert set(pair) <= {c.mechanism for c in cuts}, pair
    containers = {pair: {c.container for c in cuts if c.mechanism in pair} for pair in SPELLINGS}
    for pair in [("detach", "data"), ("no_grad", "inference_mode"), ("long", "int32")]:
        assert {"opaque-compiled", "make_fx-replay"} <= containers[pair], pair
    assert "make_fx-replay" not in containers[("item", "float")]  # .item() fails make_fx in real mode
    frozen = [b for b in bugs if "frozen-trace" in b.expect]
    assert {"tolist", "numpy"} <= {b.mechanism for b in frozen}
    assert all(b.container == "make_fx-replay" for b in frozen)

    # Healthy: a ReLU second-order term, an intended detach declared in notes, unreached parameters.
    assert len(healthy) >= 3
    mechanisms = {c.mechanism for c in healthy}
    assert {"relu-second-order", "intended-detach", "unused-head"} <= mechanisms
    declared = [c for c in healthy if c.mechanism == "intended-detach"]
    assert all(c.build(Names()).spec.notes for c in declared)


# ----- the user's own compiled function is left compiled by a probe ---------------------------------


class _Counting:
    """One torch.compile call's counter: graphs compiled, executions of compiled graphs."""

    def __init__(self, backend: str) -> None:
        self.inner = torch._dynamo.lookup_backend(backend)
        self.graphs = 0
        self.executions = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        compiled = self.inner(gm, example_inputs)

        def run(*args):
            self.executions += 1
            return compiled(*args)

        if hasattr(compiled, "_boxed_call"):
            run._boxed_call = compiled._boxed_call  # type: ignore[attr-defined]
        return run


@pytest.mark.parametrize("case_id", ["vae-detach-z-fixed", "tagger-item-conf"])
def test_user_compiled_function_stays_compiled(case_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    counters: list[_Counting] = []
    real_compile = torch.compile

    def counting_compile(fn, *args, backend="inductor", **kwargs):
        if getattr(fn, "__name__", "") != "losses" or not isinstance(backend, str):
            return real_compile(fn, *args, backend=backend, **kwargs)
        counters.append(_Counting(backend))
        return real_compile(fn, *args, backend=counters[-1], **kwargs)

    monkeypatch.setattr(torch, "compile", counting_compile)
    case = BY_ID[case_id]
    assert case.container == "opaque-compiled"
    setup = case.build(Names())
    run = user_run(setup)  # the user's own handle on their compiled trainer
    mine = counters[-1]
    terms = list(setup.spec.terms or ())
    weights = term_weights(terms, terms, next(setup.spec.model.parameters()))
    first = run(setup.spec.batch, weights)[0]
    graphs, executions = mine.graphs, mine.executions
    assert graphs >= 1 and executions >= 1

    probe(setup)
    unique = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    again = run(setup.spec.batch, weights)[0]
    assert mine.graphs == graphs, "the user's function recompiled after the probe"
    assert mine.executions == 2 * executions, "the user's compiled graphs did not run"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == unique
    torch.testing.assert_close(again, first, rtol=0, atol=0)
