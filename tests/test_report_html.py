"""The HTML report: one self-contained file with the verdict, findings, a heat-map cell per (parameter,
scenario, variant), charts; every user-derived string escaped. Checked on the HTML text and, where
Chromium is installed (CI installs it), on the DOM that headless Chromium dumps after the page's JS ran."""

from __future__ import annotations

import dataclasses
import itertools
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

import gradprobe
import gradprobe.zoo
from gradprobe.flowmap import FlowMap
from gradprobe.report.html import render_html

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "artifacts"  # CI keeps it (gitignored)
EVIL = "<script>alert(1)</script>"
EVIL_TERM = '<img src=x onerror="document.body.dataset.pwned=1">'


@pytest.fixture(scope="module")
def makefx_map() -> FlowMap:
    """make_fx on torch 2.13 loses the hidden biases for force/virial and gets most values wrong."""
    return gradprobe.probe(gradprobe.zoo.reference_spec(), variants="eager,make_fx")


@pytest.fixture(scope="module")
def eval_map() -> FlowMap:
    """Every eager run fails (model in eval mode): the heat map has only failed cells."""
    return gradprobe.probe(gradprobe.zoo.reference_spec(bug="trace-eval-mode"), diagnose=True)


@pytest.fixture(scope="module")
def evil_map() -> FlowMap:
    """A model whose parameter and term names are HTML."""
    m = torch.nn.Module()
    m.register_parameter(EVIL, torch.nn.Parameter(torch.ones(2)))
    m.register_parameter("ok", torch.nn.Parameter(torch.ones(2)))

    def step(model, batch):
        p = dict(model.named_parameters())
        return {EVIL_TERM: (p[EVIL] * batch).sum(), "plain": (p["ok"] * batch).sum()}

    return gradprobe.probe(gradprobe.ProbeSpec(model=m, step=step, batch=torch.ones(2)))


class Dom(HTMLParser):
    """What the tests need from a page: heat-map cells, script/img elements, visible text, attributes."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.cells: list[dict[str, str | None]] = []
        self.tags: dict[str, list[dict[str, str | None]]] = {}
        self.ids: dict[str, dict[str, str | None]] = {}
        self.text: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.tags.setdefault(tag, []).append(a)
        if "hm-cell" in (a.get("class") or "").split():
            self.cells.append(a)
        if a.get("id"):
            self.ids[a["id"]] = a

    def handle_data(self, data: str) -> None:
        self.text.append(data)

    @property
    def all_text(self) -> str:
        return " ".join(" ".join(self.text).split())

    def cell_keys(self) -> list[tuple[str | None, str | None, str | None]]:
        return [(c["data-parameter"], c["data-scenario"], c["data-variant"]) for c in self.cells]


def expected_keys(fm: FlowMap) -> set[tuple[str, str, str]]:
    return set(itertools.product((p.name for p in fm.parameters), fm.scenario_names, fm.variant_names))


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.skip(
        "headless Chromium not found: install it (Debian: `apt-get install -y chromium`, as .ci/run does) "
        "to check the HTML report in a browser"
    )


def browse(page: Path, profile: Path, *options: str) -> str:
    """Open ``page`` in headless Chromium (no network needed) with ``options``; its stdout."""
    command = [
        chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        *options,
        page.as_uri(),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


# ----- the HTML text ---------------------------------------------------------------------------


def test_one_heatmap_cell_per_parameter_scenario_variant(makefx_map):
    dom = Dom(render_html(makefx_map))
    keys = dom.cell_keys()
    assert len(keys) == len(set(keys)) == len(expected_keys(makefx_map)) == 14 * 4 * 2
    assert set(keys) == expected_keys(makefx_map)
    cell = {k: c for k, c in zip(keys, dom.cells, strict=True)}
    lost = cell[("fitting.layer1.bias", "force only", "make_fx")]
    assert (lost["data-status"], lost["data-verdict"]) == ("none", "missing")
    assert "k-missing" in lost["class"]
    assert "L1 norm: -" in lost["title"] and "verdict: missing" in lost["title"]
    wrong = cell[("type_embedding.weight", "force only", "make_fx")]
    assert (wrong["data-status"], wrong["data-verdict"]) == ("nonzero", "wrong")
    ref = cell[("energy_shift", "force only", "eager")]
    assert (ref["data-status"], ref["data-verdict"]) == ("none", "")
    assert "heatmap" in dom.ids


def test_sections_findings_table_and_charts(makefx_map):
    page = render_html(makefx_map)
    dom = Dom(page)
    text = dom.all_text
    assert "PROBLEM: 1 error(s) (1 info)" in text
    assert "makefx-detach" in text and "trace with detach decomposed to an alias" in text
    assert "potential.py:73" in text  # the finding's location
    assert "8/14 ⚠" in text and "reaches 8 vs 10 in eager" in text  # table and interpretation
    norms = page.split('id="norms"')[1].split("</section>")[0]
    assert norms.count("<figure>") == 3  # energy only, force only, virial only (eager)
    assert page.index('id="findings"') < page.index('id="summary"') < page.index('id="heatmap"')
    assert "Per-parameter diff" in text and "missing" in text
    assert "torch 2.13" in text or makefx_map.torch_version in text


def test_failed_runs_give_failed_cells_with_the_error(eval_map):
    dom = Dom(render_html(eval_map))
    assert set(dom.cell_keys()) == expected_keys(eval_map) and len(dom.cells) == 14 * 4
    assert {c["data-status"] for c in dom.cells} == {"failed"}
    titles = [c["title"] for c in dom.cells if c["data-scenario"] == "force only"]
    assert all("does not require grad" in t for t in titles)
    assert "trace-eval-mode" in dom.all_text and "call model.train()" in dom.all_text


def test_user_text_is_escaped(evil_map):
    page = render_html(evil_map)
    assert EVIL not in page and "<img" not in page
    dom = Dom(page)
    assert len(dom.tags["script"]) == 1  # the page's own
    assert "img" not in dom.tags
    assert EVIL in dom.all_text and EVIL_TERM in dom.all_text  # shown as text
    assert {c["data-parameter"] for c in dom.cells} == {EVIL, "ok"}


def test_checks_and_training_curves(makefx_map):
    curves = {
        "eager": {"energy": [1.0, 0.5, 0.2], "force": [3.0, "nan", 1.0]},
        "make_fx": {"energy": [1.0, 0.9]},
    }
    training = {
        "steps": 2, "optimizer": "Adam", "curves": curves, "divergence_from_reference": {"make_fx": 0.1},
        "verdicts": {"eager": {"energy": "decreases", "force": "decreases"}, "make_fx": {"energy": "decreases"}},
    }  # fmt: skip
    page = render_html(dataclasses.replace(makefx_map, checks={"training": training}))
    section = page.split('id="checks"')[1].split("</section>")[0]
    assert "training (2 Adam steps per term, on a copy):" in section  # the terminal's check lines
    assert section.count("<figure>") == 2 and section.count("<polyline") == 4  # force: a gap at nan
    assert "eager: decreases" in section
    only_curves = render_html(dataclasses.replace(makefx_map, checks={"training": {"curves": curves}}))
    assert only_curves.count("<polyline") == 4  # rendered generically from curves alone
    other = render_html(dataclasses.replace(makefx_map, checks={"training": {"passed": True}}))
    assert 'id="checks"' not in other


@pytest.mark.parametrize("name", ["makefx_map", "eval_map", "evil_map"])
def test_self_contained(name, request):
    page = render_html(request.getfixturevalue(name))
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", page, re.IGNORECASE)
    assert not re.search(r"@import|url\(|<link|<iframe|<object", page, re.IGNORECASE)


# ----- in the browser --------------------------------------------------------------------------


def test_in_chromium_heatmap_findings_and_screenshot(makefx_map, tmp_path):
    ARTIFACTS.mkdir(exist_ok=True)
    page = ARTIFACTS / "gradprobe-report-make_fx.html"
    page.write_text(render_html(makefx_map), encoding="utf-8")
    dom = Dom(browse(page, tmp_path / "profile", "--dump-dom"))
    assert dom.ids["heatmap"].get("data-ready") == "1"  # the page's JS ran
    keys = dom.cell_keys()
    assert len(keys) == len(set(keys)) and set(keys) == expected_keys(makefx_map)
    assert "makefx-detach" in dom.all_text and "trace with detach decomposed to an alias" in dom.all_text
    shot = ARTIFACTS / "gradprobe-report-make_fx.png"
    shot.unlink(missing_ok=True)
    browse(page, tmp_path / "profile2", f"--screenshot={shot}", "--window-size=1400,2000")
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")


def test_in_chromium_user_text_stays_text(evil_map, tmp_path):
    page = tmp_path / "evil.html"
    page.write_text(render_html(evil_map), encoding="utf-8")
    dom = Dom(browse(page, tmp_path / "profile", "--dump-dom"))
    assert dom.ids["heatmap"].get("data-ready") == "1"
    assert len(dom.tags["script"]) == 1 and "img" not in dom.tags
    assert "data-pwned" not in dom.tags["body"][0]
    assert EVIL in dom.all_text and EVIL_TERM in dom.all_text
    assert {c["data-parameter"] for c in dom.cells} == {EVIL, "ok"}
