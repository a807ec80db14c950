"""The Markdown report for a PR comment: verdict, findings with the fix, the GFM summary table, what
differs, the per-parameter diff (differing rows only), and user-derived text escaped."""

from __future__ import annotations

import re

import pytest

import gradprobe
import gradprobe.zoo
from gradprobe.flowmap import Cell, Finding, FlowMap, ParameterInfo, Run, ScenarioInfo, VariantInfo
from gradprobe.report.markdown import md_code, md_escape, render_markdown

EVIL = "<script>alert(1)</script>"


@pytest.fixture(scope="module")
def makefx_md() -> str:
    return render_markdown(gradprobe.probe(gradprobe.zoo.reference_spec(), variants="eager,make_fx"))


def unescaped_pipes(line: str) -> int:
    return len(re.findall(r"(?<!\\)\|", line))


def test_summary_table(makefx_md):
    assert (
        "| scenario | eager | make_fx |\n"
        "| --- | ---: | ---: |\n"
        "| energy only | 12/14 | 12/14 |\n"
        "| force only | 10/14 | 8/14 ⚠ |\n"
        "| virial only | 10/14 | 8/14 ⚠ |\n"
        "| all | 12/14 | 12/14 ⚠ |\n"
    ) in makefx_md
    assert "⚠ = differs from eager in reach or value, rtol 1e-07" in makefx_md


def test_verdict_findings_and_interpretation(makefx_md):
    assert makefx_md.startswith("## gradprobe: PROBLEM: 1 error(s) (1 info)\n")
    assert "**🛑 ERROR** `makefx-detach`: the traced path drops second-order gradients" in makefx_md
    assert "- **fix:** trace with detach decomposed to an alias" in makefx_md
    assert "- **where:** `potential.py:73`" in makefx_md
    assert "- force only, make_fx: reaches 8 vs 10 in eager; lost: " in makefx_md
    assert makefx_md.index("makefx-detach") < makefx_md.index("| scenario |")


def test_diff_tables_hold_only_differing_rows(makefx_md):
    diff = makefx_md.split("Per-parameter diff")[1].split("</details>")[0]
    assert "| fitting.layer1.bias | nonzero | none | 1 | **missing** |" in diff
    assert "| type_embedding.weight | nonzero | nonzero | 1.02 | **wrong** |" in diff
    assert "| fitting.out.weight |" not in diff and "| aux_head.bias |" not in diff
    assert diff.count("| parameter | eager | make_fx | rel. error | verdict |") == 3
    assert "**energy only**" not in diff  # no differences there


def test_failed_runs_show_the_error():
    fm = gradprobe.probe(gradprobe.zoo.reference_spec(bug="trace-eval-mode"), diagnose=True)
    md = render_markdown(fm)
    assert "| force only | no grad path |" in md and "| energy only | error: RuntimeError |" in md
    assert "`trace-eval-mode`" in md


def evil_map() -> FlowMap:
    names = (EVIL, "a|b", "`tick`", "__init__")
    params = tuple(ParameterInfo(n, (2,), 2, True, "float64", "cpu") for n in names)
    scenarios = (ScenarioInfo("<b>x</b> only", ("<b>x</b>",)),)
    cells = tuple(Cell("eager", scenarios[0].name, n, "nonzero", 1.0) for n in names) + tuple(
        Cell("make_fx", scenarios[0].name, n, "zero", 0.0, 1.0, "missing") for n in names
    )
    runs = (Run("eager", scenarios[0].name), Run("make_fx", scenarios[0].name))
    finding = Finding(
        "makefx-detach",
        "error",
        f"lost {EVIL} and a|b",
        {},
        {"file": "/x/m.py", "line": 3, "code": "y = x | `z`"},
        "fix <it>",
    )
    return FlowMap(
        torch_version="2.13.0", device="cpu", dtype="float64", mode="terms", terms=("<b>x</b>",),
        scenarios=scenarios, variants=(VariantInfo("eager"), VariantInfo("make_fx")), runs=runs,
        parameters=params, cells=cells, findings=(finding,),
    )  # fmt: skip


def test_user_text_is_escaped():
    md = render_markdown(evil_map())
    assert EVIL not in md and "<b>" not in md and "<it>" not in md
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in md and "&lt;b&gt;x&lt;/b&gt; only" in md
    for line in md.splitlines():
        if line.startswith("| "):  # every table row keeps its columns
            assert unescaped_pipes(line) in (4, 6), line
    assert "| a\\|b | nonzero | zero | 1 | **missing** |" in md
    assert "\\`tick\\`" in md and "\\_\\_init\\_\\_" in md
    assert "- **code:** ``y = x | `z```" not in md and "- **code:** `` y = x | `z` ``" in md


def test_escape_helpers():
    assert md_escape("a_b.c") == "a_b.c"  # intra-word underscores stay readable
    assert md_escape("x\ny|z") == "x y\\|z"
    assert md_code("a ``b`` c") == "```a ``b`` c```"
