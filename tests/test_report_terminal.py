"""The terminal rendering: the summary table (several variants), meanings, findings."""

from gradprobe.flowmap import Cell, FlowMap, ParameterInfo, Run, RunError, ScenarioInfo, VariantInfo
from gradprobe.report.terminal import render, summary_table


def two_variant_map():
    params = tuple(ParameterInfo(n, (2,), 2, True, "float64", "cpu") for n in ("a.w", "a.b", "c.w"))
    scenarios = (ScenarioInfo("energy only", ("energy",)), ScenarioInfo("force only", ("force",)))
    status = {
        ("eager", "energy only"): ("nonzero", "nonzero", "nonzero"),
        ("eager", "force only"): ("nonzero", "nonzero", "none"),
        ("make_fx", "energy only"): ("nonzero", "nonzero", "nonzero"),
    }
    cells = tuple(
        Cell(v, s, p.name, st, 1.0 if st == "nonzero" else None)
        for (v, s), sts in status.items()
        for p, st in zip(params, sts, strict=True)
    )
    runs = tuple(Run(v, s, {}, None, None) for v, s in status) + (
        Run("make_fx", "force only", {}, None, RunError("backward", "RuntimeError", "double backward")),
    )
    return FlowMap(
        torch_version="2.13.0", device="cpu", dtype="float64", mode="terms", terms=("energy", "force"),
        scenarios=scenarios, variants=(VariantInfo("eager"), VariantInfo("make_fx")), runs=runs,
        parameters=params, cells=cells, notes={"c": "head used by energy only"},
    )  # fmt: skip


def test_summary_table_with_several_variants():
    assert summary_table(two_variant_map()) == (
        "                       eager   make_fx\n"
        "energy only:           3/3     3/3\n"
        "force only:            2/3     error: double backward unsupported"
    )


def test_the_failing_cells_say_so_and_the_footer_counts_them():
    text = render(two_variant_map())
    assert "<-- problem" not in text  # the cells point at themselves, not a marker after the last column
    assert "problem cells: 1 failed (error), of 4 runs" in text


def test_render_explains_unreached_with_notes():
    text = render(two_variant_map())
    assert "force only: 1 not reached: c.w (head used by energy only)" in text
    assert text.startswith("gradprobe: OK: no problem found")
