"""The terminal rendering: the summary table (several variants), meanings, findings; tables that fit
the width, their headers wrapped only between a variant's stages and knobs."""

import re

import pytest

from gradprobe.flowmap import Cell, FlowMap, ParameterInfo, Run, RunError, ScenarioInfo, VariantInfo
from gradprobe.report.terminal import render, summary_table

DEFAULT_WIDTH = 100  # the tables' width in plain text when none is asked for


def header_pieces(name: str) -> list[str]:
    """Where a header may wrap: after ':' or ',', before '[' or '+'."""
    return [p for p in re.split(r"(?<=[:,])(?=.)|(?=[\[+])", name) if p]


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


# The README's variants and the long names users give their own paths.
MANY = (
    "eager",
    "make_fx",
    "compile:eager",
    "compile:aot_eager",
    "compile_model:aot_eager",
    "make_fx[detach=alias]+compile",
    "make_fx[detach=alias]+compile:aot_eager",
)


def many_variant_map(variants=MANY, failing=("compile:aot_eager",)):
    """Every variant on four scenarios; the ``failing`` ones fail at backward on every scenario."""
    params = tuple(ParameterInfo(n, (2,), 2, True, "float64", "cpu") for n in ("a.w", "a.b", "c.w"))
    names = ("energy only", "force only", "virial only", "all")
    scenarios = tuple(ScenarioInfo(s, (s.split()[0],) if s != "all" else ("energy",)) for s in names)
    cells = tuple(
        Cell(v, s, p.name, "nonzero", 1.0)
        for v in variants
        if v not in failing
        for s in names
        for p in params
    )
    error = RunError("backward", "RuntimeError", "double backward")
    runs = tuple(Run(v, s, {}, None, error if v in failing else None) for v in variants for s in names)
    return FlowMap(
        torch_version="2.13.0", device="cpu", dtype="float64", mode="terms", terms=("energy", "force", "virial"),
        scenarios=scenarios, variants=tuple(VariantInfo(v) for v in variants), runs=runs, parameters=params,
        cells=cells,
    )  # fmt: skip


def table_block(text: str, first_row: str = "energy only:") -> list[list[str]]:
    """The header lines of each table in ``text``: the lines above each row that starts ``first_row``,
    up to the end of the title or the blank line that ends the table before."""
    lines = text.splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.startswith(first_row):
            j = i
            while j > 0 and lines[j - 1].strip() and not lines[j - 1].endswith("float64:"):
                j -= 1
            blocks.append(lines[j:i])
    return blocks


def assert_headers_whole(text: str, variants=MANY) -> None:
    """Every header token is one or more consecutive pieces of a variant's name (cut only at ':', ',',
    '[' or '+'), and every piece of every name is in a header."""
    allowed = set()
    for v in variants:
        pieces = header_pieces(v)
        allowed |= {"".join(pieces[i:j]) for i in range(len(pieces)) for j in range(i + 1, len(pieces) + 1)}
    tokens = [t for block in table_block(text) for line in block for t in re.split(r"\s{2,}", line.strip())]
    assert tokens and all(t in allowed for t in tokens), (tokens, text)
    joined = " ".join(tokens)
    for v in variants:
        for piece in header_pieces(v):
            assert piece in joined, (piece, text)


@pytest.mark.parametrize("width", [80, 120])
def test_tables_fit_the_width_and_headers_break_only_between_stages(width):
    text = render(many_variant_map(), width=width)
    assert all(len(line) <= width for line in text.splitlines()), text
    assert_headers_whole(text)
    for row in ("energy only:", "force only:", "virial only:", "all:"):
        assert row in text


def test_a_table_too_wide_for_the_width_is_split_with_its_row_labels():
    variants = (
        *MANY,
        *(f"compile:{b}[mode=eval,dynamic=true]" for b in ("inductor", "aot_eager_decomp_partition")),
    )
    text = render(many_variant_map(variants), width=80)
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert len(table_block(text)) >= 2  # more than one table, each with the scenarios' labels
    assert_headers_whole(text, variants)
    assert "error: double" in text and "unsupported" in text  # a long cell wraps at its words


def test_columns_is_honoured_and_plain_text_defaults_to_100_columns(monkeypatch):
    fm = many_variant_map()
    monkeypatch.delenv("COLUMNS", raising=False)
    text = render(fm)
    table = summary_table(fm)
    assert max(len(line) for line in table.splitlines()) <= DEFAULT_WIDTH
    assert table in text
    # Without a width asked for, a line of prose stays whole (for grep, files, tests).
    assert "compile:aot_eager: fails at backward: double backward" in text
    monkeypatch.setenv("COLUMNS", "64")
    narrow = render(fm)
    assert all(len(line) <= 64 for block in table_block(narrow) for line in block), narrow
    assert "compile:aot_eager: fails at backward: double backward" in narrow  # prose still whole
    assert_headers_whole(narrow)
    assert summary_table(fm, width=64) in narrow


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


def test_the_trial_table_fits_the_width_too():
    import msgspec

    long = "does not match yet: 8 reached, differs from the reference (wrong: a.w, a.b; missing: c.w) " * 2
    trials = [
        {
            "change": "detach=keep → alias",
            "ok": True,
            "result": "force only: 10 reached, matches",
            "seconds": 2.9,
        },
        {"change": "mode=train → eval", "ok": False, "result": long.strip(), "seconds": 2.66},
    ]
    fm = msgspec.structs.replace(
        many_variant_map(), bisections=[{"variant": "make_fx", "scenarios": ["force only"], "trials": trials}]
    )
    for width in (80, 120):
        text = render(fm, width=width)
        assert all(len(line) <= width for line in text.splitlines()), text
        assert "bisect make_fx (on force only):" in text
        assert "  flip                 seconds  result" in text
        assert "  mode=train → eval       2.66  does not match" in text  # flips whole, seconds right-aligned
    assert "  detach=keep → alias     2.90  matches: force only: 10 reached, matches" in render(fm)
