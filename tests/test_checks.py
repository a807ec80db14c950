"""Verification checks: consistency at float64 precision, physics, shape sweep, training steps."""

import pytest

import gradprobe
from gradprobe.zoo import reference_spec

FIXED = "make_fx[detach=alias]+compile:aot_eager"


@pytest.fixture(scope="module")
def checked():
    return gradprobe.probe(
        reference_spec(), variants=f"eager,make_fx,{FIXED}", checks=["physics", "shapes", "training"]
    )


def test_consistency_passes_at_1e_10_for_a_correct_compiled_path(checked):
    c = checked.checks["consistency"]
    # The relative L1 error per parameter (as the table's cells), at 1e-10 in float64.
    assert (c["rtol"], c["table_rtol"]) == (1e-10, 1e-7)
    fixed = c["variants"][FIXED]
    assert fixed["passed"] and fixed["checked_cells"] == 48 and fixed["failed_cells"] == 0


def test_consistency_fails_for_raw_make_fx_naming_parameters(checked):
    raw = checked.checks["consistency"]["variants"]["make_fx"]
    assert not raw["passed"]
    worst = {w["parameter"] for w in raw["worst"]}
    # Worst by relative error (the lost biases count 1.0): the embeddings off by up to 3x lead.
    assert {"fitting.layer1.bias", "descriptor.embed1.bias"} <= worst
    assert all(w["rel_error"] > 1e-3 for w in raw["worst"])
    # Every cell the table marks fails the check too: one tolerance story.
    table = {(s, p) for s in checked.scenario_names for p in checked.differences("make_fx", s)}
    assert raw["failed_cells"] >= len(table) > 0


def test_clean_potential_passes_physics_to_1e_8(checked):
    p = checked.checks["physics"]
    assert p["passed"] and p["failures"] == []
    assert p["force"]["max_rel_error"] < 1e-8
    assert p["sum_rule"]["relative"] < 1e-12
    assert p["virial"]["max_rel_error"] < 1e-8 and p["virial"]["asymmetry"] < 1e-12


def test_ghost_force_slice_fails_physics_and_is_named(zoo_map):
    fm = zoo_map("ghost-force-slice", checks=("physics",), diagnose=False)
    p = fm.checks["physics"]
    assert not p["passed"] and p["force"]["max_rel_error"] > 0.05
    assert any("differ from -dE/dx" in f for f in p["failures"])
    assert any("do not sum to zero" in f for f in p["failures"])
    # Counts are unchanged: the flow map alone would call it healthy.
    assert fm.count("eager", "force only") == (10, 14)
    assert sorted(f.cause for f in fm.findings if f.severity == "error") == ["ghost-force-slice"]


def test_shape_sweep_shows_traces_locked_to_their_shapes(checked):
    sweep = checked.checks["shape_sweep"]
    assert set(sweep) == {"make_fx", FIXED}
    assert all(entry["error"] for entry in sweep.values())
    locked = [f for f in checked.findings if f.cause == "shape-locked"]
    assert {f.evidence["variant"] for f in locked} == {"make_fx", FIXED}
    assert all(f.severity == "warning" for f in locked)


def test_training_check_every_term_decreases_in_eager_and_fixed_compile(checked):
    t = checked.checks["training"]
    assert t["steps"] == 5 and t["optimizer"] == "Adam"
    for v in ("eager", FIXED):
        assert t["verdicts"][v] == {"energy": "decreases", "force": "decreases", "virial": "decreases"}
        assert len(t["curves"][v]["force"]) == 6
    assert t["divergence_from_reference"][FIXED] < 1e-8
    assert t["divergence_from_reference"]["make_fx"] > 1e-4  # wrong gradients, another trajectory


def test_training_check_flags_eval_mode_force_terms():
    fm = gradprobe.probe(reference_spec(bug="trace-eval-mode"), checks=["training"])
    verdicts = fm.checks["training"]["verdicts"]["eager"]
    assert verdicts["force"] == "error" and verdicts["virial"] == "error"
    # Forces computed without create_graph: the backward either has no path or hits the freed graph.
    assert any(
        m in fm.checks["training"]["errors"]["eager"]["force"] for m in ("no gradient path", "second time")
    )


def test_norm_mismatch_is_named_from_term_values(zoo_map):
    fm = zoo_map("norm-mismatch", diagnose=False)
    assert sorted(f.cause for f in fm.findings if f.severity == "error") == ["norm-mismatch"]
    f = next(f for f in fm.findings if f.cause == "norm-mismatch")
    assert f.evidence["term"] == "virial" and f.evidence["factor"] == pytest.approx(64.0)


def test_checks_leave_the_model_untouched():
    import torch

    spec = reference_spec()
    model = spec.model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    import dataclasses

    gradprobe.probe(dataclasses.replace(spec, model=model), checks=["physics", "training"])
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())


def test_unknown_check():
    with pytest.raises(gradprobe.SpecError, match="unknown check 'physic' \\(did you mean 'physics'\\?\\)"):
        gradprobe.probe(reference_spec(), checks=["physic"])
