"""Regression guards: each zoo bug is caught by assert_grad_flow or a snapshot; the clean model passes."""

import pytest

from gradprobe.testing import Snapshot, assert_grad_flow, flow_changes
from gradprobe.zoo.bugs import BUGS

# Balance findings that are warnings by design (the clean potential has a force/virial conflict at
# initialisation): their own tests in test_balance.py assert them.
WARNING_ONLY = {"term-dominated", "terms-conflict"}


def test_clean_reference_passes_the_guard(zoo_map):
    fm = zoo_map(None, variants="eager,make_fx[detach=alias]+compile:aot_eager", checks=("physics",))
    assert_grad_flow(
        fm,
        reaches={"force only": ["fitting.layer1", "fitting.layer2", "descriptor."]},
        not_reaches={"force only": ["energy_shift", "aux_head"]},
    )


@pytest.mark.parametrize("bug", [b for b in BUGS if b not in WARNING_ONLY])
def test_guard_fails_on_each_injected_bug(bug, zoo_map):
    fm = zoo_map(bug, checks=BUGS[bug].checks)
    with pytest.raises(AssertionError, match="gradient flow broken") as info:
        assert_grad_flow(fm)
    assert bug in str(info.value)  # the message names the cause


def test_guard_messages_name_term_parameters_and_variant(zoo_map):
    fm = zoo_map("makefx-detach")
    with pytest.raises(AssertionError) as info:
        assert_grad_flow(fm, allow=["makefx-detach"])
    text = str(info.value)
    assert "force only in make_fx+compile:aot_eager: fitting.layer1.bias is missing against eager" in text


SNAPSHOT = __import__("pathlib").Path(__file__).parent / "__gradprobe__" / "reference_eager.flow.json"


def test_snapshot_of_the_clean_reference_matches(zoo_map):
    Snapshot(SNAPSHOT).match(zoo_map(None, diagnose=False))


@pytest.mark.parametrize("bug", ["graph-break-in-model", "trace-eval-mode", "nonfinite-grad"])
def test_snapshot_fails_when_a_bug_comes_back(bug, zoo_map):
    with pytest.raises(AssertionError, match="differs from the snapshot") as info:
        Snapshot(SNAPSHOT).match(zoo_map(bug, diagnose=False))
    assert "--gradprobe-update" in str(info.value)


def test_none_vs_zero_and_timings_are_not_changes():
    import gradprobe
    from gradprobe.zoo import reference_spec

    terms = gradprobe.probe(reference_spec(mode="terms"))  # unreached: none
    weights = gradprobe.probe(reference_spec(mode="weights"))  # unreached: zero, other timings
    assert terms.cell("eager", "force only", "energy_shift").status == "none"
    assert weights.cell("eager", "force only", "energy_shift").status == "zero"
    assert flow_changes(terms, weights, norm_rtol=1e-9) == []
