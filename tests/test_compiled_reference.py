"""Compiled and traced variants on the reference potential: the torch 2.13 facts, value by value.

One module-scoped probe (about 25 s on 2 cores) serves every test here.
"""

import json

import pytest

import gradprobe
from gradprobe.cli import main
from gradprobe.report.terminal import diff_lines, render

VARIANTS = "eager,make_fx,compile:eager,compile:aot_eager,make_fx[detach=alias]+compile:aot_eager"
FIXED = "make_fx[detach=alias]+compile:aot_eager"
LOST = {"fitting.layer1.bias", "fitting.layer2.bias"}


@pytest.fixture(scope="module")
def fm():
    return gradprobe.probe(gradprobe.zoo.reference_spec(), variants=VARIANTS)


@pytest.mark.parametrize("scenario", ["force only", "virial only"])
def test_make_fx_loses_hidden_biases_and_gets_values_wrong(fm, scenario):
    diffs = fm.differences("make_fx", scenario)
    missing = {p for p, c in diffs.items() if c.verdict == "missing"}
    wrong = {p for p, c in diffs.items() if c.verdict == "wrong"}
    assert missing == LOST
    # Only the scenario's own term is differentiated (never the others times 0): the recorded detach
    # leaves the lost biases no gradient at all.
    assert {fm.cell("make_fx", scenario, p).status for p in LOST} == {"none"}
    assert fm.count("make_fx", scenario) == (8, 14) and fm.count("eager", scenario) == (10, 14)
    # Most of what it still reaches is wrong: counts alone would miss this.
    assert len(wrong) == 7 and all(fm.cell("make_fx", scenario, p).rel_error > 1e-3 for p in wrong)
    assert "fitting.out.weight" not in wrong  # the output layer needs no saved activation's gradient


def test_make_fx_all_scenario_has_equal_counts_and_wrong_values(fm):
    assert fm.count("make_fx", "all") == fm.count("eager", "all")
    assert sum(c.verdict == "wrong" for c in fm.cells_of("make_fx", "all").values()) == 9
    assert fm.cells_of("make_fx", "energy only") and not fm.differences("make_fx", "energy only")


def test_direct_aot_eager_compile_is_a_recorded_double_backward_failure(fm):
    for s in fm.scenario_names:
        err = fm.run("compile:aot_eager", s).error
        assert (err.stage, err.type) == ("backward", "RuntimeError")
        assert err.message == "torch.compile with aot_autograd does not currently support double backward"
    assert fm.variant("compile:aot_eager").error is None  # it built; it fails when run


def test_detach_decomposed_and_compiled_matches_eager_everywhere(fm):
    cells = [c for s in fm.scenario_names for c in fm.cells_of(FIXED, s).values() if c.rel_error is not None]
    assert len(cells) == 4 * 12  # every reached-or-compared cell
    assert all(c.verdict == "match" for s in fm.scenario_names for c in fm.cells_of(FIXED, s).values())
    assert max(c.rel_error for c in cells) <= 1e-10
    text = render(fm)
    assert f"{FIXED}: " in text and "matches eager on all 56 cells" in text


def test_compile_eager_backend_matches(fm):
    assert not any(fm.differences("compile:eager", s) for s in fm.scenario_names)


def test_each_compiled_variant_compiles_once_across_scenarios(fm):
    for name in ("compile:eager", "compile:aot_eager", FIXED):
        v = fm.variant(name)
        assert v.compile_count == 1, name  # one dynamo cache entry for 4 scenarios
        assert v.graphs >= 1
    assert fm.variant(FIXED).graphs == 1 and fm.variant(FIXED).graph_breaks == 0
    assert fm.variant("compile:eager").graph_breaks > 0  # autograd.grad breaks the direct graph
    assert fm.variant("make_fx").compile_count is None


def test_second_batch_checked_for_traced_variants(fm):
    assert fm.variant(FIXED).second_batch["mismatched"] == []
    assert fm.variant(FIXED).second_batch["scenario"] == "all"
    assert fm.variant("eager").second_batch is None


def test_json_holds_errors_compile_counts_and_relative_errors(fm):
    d = json.loads(fm.to_json())
    variants = {v["name"]: v for v in d["variants"]}
    assert variants["compile:aot_eager"]["compile_count"] == 1
    runs = [r for r in d["runs"] if r["variant"] == "compile:aot_eager"]
    assert all(r["error"]["stage"] == "backward" for r in runs)
    cell = next(c for c in d["cells"] if c["variant"] == "make_fx" and c["scenario"] == "force only"
                and c["parameter"] == "fitting.layer1.bias")  # fmt: skip
    assert cell["verdict"] == "missing" and cell["rel_error"] == 1.0
    assert gradprobe.FlowMap.from_json(fm.to_json()) == fm


def test_table_marks_problems_and_exit_code(fm):
    text = render(fm)
    force_row = next(line for line in text.splitlines() if line.startswith("force only:"))
    assert (
        "10/14" in force_row and "8/14 !" in force_row and "error: double backward unsupported" in force_row
    )
    assert "problem cells: 3 differ from eager (!) and 4 failed (error), of 20 runs" in text
    assert "force only, make_fx: reaches 8 vs 10 in eager; lost: " in text
    assert "all, make_fx: 12 reached, like eager, but values differ" in text
    assert fm.exit_code == 1


def test_per_parameter_diff(fm):
    lines = diff_lines(fm, "make_fx", "force only")
    assert lines[0] == "force only: eager vs make_fx"
    bias = next(line for line in lines if line.strip().startswith("fitting.layer1.bias"))
    assert bias.split()[1:4] == ["nonzero", "none", "1"] and bias.endswith("<-- DIFF missing")
    assert lines[-1] == "  (5 identical parameters omitted, use --all to show)"
    assert len(diff_lines(fm, "make_fx", "force only", show_all=True)) == 2 + 14


def test_demo_cli_exits_1_on_a_broken_variant(capsys):
    assert main(["demo", "--variants", "eager,make_fx"]) == 1
    out = capsys.readouterr().out
    # Named by its cause from the graph lint alone (no --diagnose): the recorded detach nodes.
    assert "ERROR makefx-detach: the traced path drops second-order gradients (PyTorch #175477)" in out
    assert "lost: fitting.layer1.bias, fitting.layer2.bias" in out
