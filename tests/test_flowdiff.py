"""Comparing two saved flow maps (``gradprobe diff``), and rendering a saved one (``gradprobe report``,
``--html`` / ``--markdown`` on ``demo``)."""

from __future__ import annotations

import json

import msgspec
import pytest

from gradprobe.cli import main
from gradprobe.flowdiff import diff_maps
from gradprobe.flowmap import FlowMap


@pytest.fixture(scope="module")
def maps(tmp_path_factory):
    """Flow maps of the demo written by the CLI: clean twice, eval-mode bug, detach in the model."""
    d = tmp_path_factory.mktemp("maps")
    paths = {name: str(d / f"{name}.json") for name in ("clean", "clean2", "eval", "detach")}
    assert main(["demo", "--json", paths["clean"]]) == 0
    assert main(["demo", "--json", paths["clean2"]]) == 0
    assert main(["demo", "--bug", "trace-eval-mode", "--json", paths["eval"]]) == 1
    assert main(["demo", "--bug", "graph-break-in-model", "--json", paths["detach"]]) == 1
    return paths


def test_runs_that_start_failing_are_listed_and_exit_1(maps, capsys):
    capsys.readouterr()
    assert main(["diff", maps["clean"], maps["eval"]]) == 1
    out = capsys.readouterr().out
    assert out.startswith("flow changed: 4 run(s), 1 error finding(s)\n")
    assert (
        "  eager, force only: started failing at backward: NoGradPath: term 'force' does not require grad"
        in out
    )
    assert "    reached before: type_embedding.weight, descriptor.embed1.weight," in out
    assert "error finding added: trace-eval-mode:" in out
    assert main(["diff", maps["eval"], maps["clean"]]) == 1
    assert "eager, force only: stopped failing (was failing at backward" in capsys.readouterr().out


def test_changed_cells_are_listed(maps, capsys):
    capsys.readouterr()
    assert main(["diff", maps["clean"], maps["detach"]]) == 1
    out = capsys.readouterr().out
    assert "cells that changed (variant, scenario, parameter: before -> after):" in out
    for s in ("energy only", "force only", "virial only", "all"):
        for p in ("descriptor.embed1.weight", "descriptor.embed1.bias"):
            assert f"  eager, {s}, {p}: nonzero -> none\n" in out
    assert out.count(": nonzero -> ") == 8
    assert "error finding added: graph-break-in-model" in out
    assert "norm(s) moved by more than 1e-07 (relative; not a flow change)" in out


def test_identical_runs_exit_0(maps, capsys):
    capsys.readouterr()
    assert main(["diff", maps["clean"], maps["clean2"]]) == 0
    assert capsys.readouterr().out == "flow unchanged\n"


def replace_cells(fm: FlowMap, *, where, how) -> FlowMap:
    """``fm`` with each cell for which ``where(cell)`` holds replaced by ``how(cell)``."""
    return msgspec.structs.replace(fm, cells=tuple(how(c) if where(c) else c for c in fm.cells))


def test_none_and_zero_are_the_same_flow_but_norms_are_info_only(maps):
    fm = FlowMap.from_json(maps["clean"])
    zeros = replace_cells(
        fm,
        where=lambda c: c.status == "none",
        how=lambda c: msgspec.structs.replace(c, status="zero", norm=0.0),
    )
    d = diff_maps(fm, zeros)
    assert not d.changed and d.render() == "flow unchanged\n"
    scaled = replace_cells(
        fm, where=lambda c: c.norm, how=lambda c: msgspec.structs.replace(c, norm=c.norm * 1.5)
    )
    d = diff_maps(fm, scaled)
    assert not d.changed and len(d.norms) == sum(bool(c.norm) for c in fm.cells)
    assert not diff_maps(fm, scaled, norm_rtol=0).norms
    nan = replace_cells(
        fm,
        where=lambda c: c.parameter == "fitting.out.weight",
        how=lambda c: msgspec.structs.replace(c, status="nan"),
    )
    d = diff_maps(fm, nan)
    assert d.changed and {(c.status_before, c.status_after) for c in d.cells} == {("nonzero", "nan")}


def test_verdicts_and_added_or_removed_names(maps):
    fm = FlowMap.from_json(maps["clean"])
    two = msgspec.structs.replace(
        fm,
        variants=(*fm.variants, msgspec.structs.replace(fm.variants[0], name="make_fx")),
        runs=fm.runs + tuple(msgspec.structs.replace(r, variant="make_fx") for r in fm.runs),
        cells=fm.cells
        + tuple(msgspec.structs.replace(c, variant="make_fx", verdict="match") for c in fm.cells),
    )
    d = diff_maps(fm, two)
    assert d.changed and d.added["variants"] == ("make_fx",) and not d.cells
    assert "variants added: make_fx" in d.render()
    wrong = replace_cells(
        two,
        where=lambda c: c.variant == "make_fx" and c.parameter == "energy_shift" and c.scenario == "all",
        how=lambda c: msgspec.structs.replace(c, verdict="wrong"),
    )
    d = diff_maps(two, wrong)
    assert d.changed and [c.parameter for c in d.cells] == ["energy_shift"]
    assert "make_fx, all, energy_shift: verdict match -> wrong" in d.render()
    fewer = msgspec.structs.replace(fm, parameters=fm.parameters[:-1])
    assert diff_maps(fm, fewer).removed["parameters"] == ("aux_head.bias",)


def test_bad_files_exit_2(maps, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"schema": "something/1"}))
    for path in (bad, other, tmp_path / "missing.json"):
        capsys.readouterr()
        assert main(["diff", maps["clean"], str(path)]) == 2
        assert capsys.readouterr().err.startswith("gradprobe: error: ")
    assert main(["report", str(bad)]) == 2


def test_report_writes_html_and_markdown(maps, tmp_path, capsys):
    html, md = tmp_path / "out.html", tmp_path / "out.md"
    capsys.readouterr()
    assert main(["report", maps["detach"], "--html", str(html), "--markdown", str(md)]) == 1
    out = capsys.readouterr().out
    assert f"HTML report written to {html}" in out and f"Markdown report written to {md}" in out
    assert 'id="heatmap"' in html.read_text() and "graph-break-in-model" in html.read_text()
    assert md.read_text().startswith("## gradprobe: PROBLEM: 1 error(s)")
    assert main(["report", maps["clean"]]) == 0
    assert "gradprobe: OK: no problem found" in capsys.readouterr().out


def test_demo_writes_reports_too(tmp_path, capsys):
    html, md = tmp_path / "demo.html", tmp_path / "demo.md"
    assert main(["demo", "--no-virial", "--html", str(html), "--markdown", str(md)]) == 0
    out = capsys.readouterr().out
    assert "parameters reached per scenario" in out and "HTML report written to" in out
    assert "| force only | 10/14 |" in md.read_text() and "hm-cell" in html.read_text()
