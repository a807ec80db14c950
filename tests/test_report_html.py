"""The HTML report: one self-contained file with the verdict, findings, a heat-map cell per (parameter,
scenario, variant), charts; every user-derived string escaped. Checked on the HTML text and, where
Chromium is installed (CI installs it), on the DOM that headless Chromium dumps after the page's JS ran."""

from __future__ import annotations

import html
import itertools
import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import msgspec
import pytest
import torch

import gradprobe
import gradprobe.zoo
from gradprobe.flowmap import FlowMap
from gradprobe.report.html import HEADER_CHARS, _short, esc, render_html

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "artifacts"  # CI keeps it (gitignored)
EVIL = "<script>alert(1)</script>"
EVIL_TERM = '<img src=x onerror="document.body.dataset.pwned=1">'
LONG = "make_fx[detach=alias]+compile:aot_eager"
FAILING = "compile:aot_eager"
WIDE = f"eager,make_fx,{LONG},{FAILING}"


@pytest.fixture(scope="module")
def makefx_map() -> FlowMap:
    """make_fx on torch 2.13 loses the hidden biases for force/virial and gets most values wrong."""
    return gradprobe.probe(gradprobe.zoo.reference_spec(), variants="eager,make_fx")


@pytest.fixture(scope="module")
def eval_map() -> FlowMap:
    """Every eager run fails (model in eval mode): the heat map has only failed cells."""
    return gradprobe.probe(gradprobe.zoo.reference_spec(bug="trace-eval-mode"), diagnose=True)


@pytest.fixture(scope="module")
def wide_map() -> FlowMap:
    """What a real report holds: a long variant name, a variant whose every run fails (aot_eager cannot
    double-backward), and the training, balance and physics checks."""
    spec = gradprobe.zoo.reference_spec(bug="makefx-detach")
    return gradprobe.probe(spec, variants=WIDE, checks=["training", "balance", "physics"], progress=False)


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
    """Headless Chromium's path; without it the browser tests skip, except in CI (``CI`` or
    ``GRADPROBE_REQUIRE_CHROMIUM`` set), where they fail."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    why = (
        "headless Chromium not found: install it (Debian: `apt-get install -y chromium`, as .ci/run does) "
        "to check the HTML report in a browser"
    )
    if os.environ.get("CI") or os.environ.get("GRADPROBE_REQUIRE_CHROMIUM"):
        pytest.fail(why)
    pytest.skip(why)


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
    assert norms.count("<figure") == 3  # energy only, force only, virial only
    # the first screen: verdict, a line per finding, the heat map; the details below
    assert page.index('id="verdict"') < page.index('id="overview"') < page.index('id="heatmap"')
    assert page.index('id="heatmap"') < page.index('id="findings"') < page.index('id="summary"')
    assert "Per-parameter diff" in text and "missing" in text
    assert "torch 2.13" in text or makefx_map.torch_version in text


def test_failed_runs_give_failed_cells_with_the_error(eval_map):
    dom = Dom(render_html(eval_map))
    assert set(dom.cell_keys()) == expected_keys(eval_map) and len(dom.cells) == 14 * 4
    assert {c["data-status"] for c in dom.cells} == {"failed"}
    titles = [c["title"] for c in dom.cells if c["data-scenario"] == "force only"]
    assert all("does not require grad" in t for t in titles)
    assert "trace-eval-mode" in dom.all_text and "call model.train()" in dom.all_text
    norms = section_of(render_html(eval_map), "norms")  # each bar a failed one, with the reason below
    assert norms.count('data-variant="eager" data-kind="failed"') == 3 * len(eval_map.trainable)
    assert "run failed</span>" in norms and norms.count("</svg>eager: run failed — backward") == 3


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
    page = render_html(msgspec.structs.replace(makefx_map, checks={"training": training}))
    section = page.split('id="checks"')[1].split("</section>")[0]
    assert "training (2 Adam steps per term, on a copy):" in section  # the terminal's check lines
    assert section.count("<figure") == 2 and section.count("<polyline") == 4  # force: a gap at nan
    assert "eager: decreases" in section
    only_curves = render_html(msgspec.structs.replace(makefx_map, checks={"training": {"curves": curves}}))
    assert only_curves.count("<polyline") == 4  # rendered generically from curves alone
    other = render_html(msgspec.structs.replace(makefx_map, checks={"training": {"passed": True}}))
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


# ----- the issue-19 flaws: headers, balance, curves, per-term charts ------------------------------


def section_of(page: str, sid: str) -> str:
    return page.split(f'id="{sid}"')[1].split("</section>")[0]


def renamed(fm: FlowMap, old: str, new: str) -> FlowMap:
    """``fm`` with variant ``old`` called ``new`` everywhere (through its JSON)."""
    return FlowMap.from_dict(json.loads(fm.to_json().replace(json.dumps(old), json.dumps(new))))


def test_heatmap_headers_hold_the_whole_name(wide_map):
    page = render_html(wide_map)
    dom = Dom(page)
    heads = [a for a in dom.tags["th"] if "vname" in (a.get("class") or "")]
    assert [a["title"] for a in heads] == list(wide_map.variant_names) * len(wide_map.scenarios)
    assert f"<span>{LONG}</span>" in page  # 39 characters: shown whole, the header row grows to fit it
    assert "max-height" not in page.split(".heatmap .vname span")[1].split("}")[0]
    assert "shortened column names" not in page
    huge = "make_fx[detach=alias,tracing_mode=symbolic,pre_dispatch=true]+compile:aot_eager_decomp_partition"
    page = render_html(renamed(wide_map, LONG, huge))
    short = _short(huge)
    assert (
        len(short) == HEADER_CHARS
        and short.startswith("make_fx[detach=")
        and short.endswith("decomp_partition")
    )
    assert f'title="{esc(huge)}"><span>{esc(short)}</span>' in page
    assert f"<code>{esc(short)}</code> = <code>{esc(huge)}</code>" in page  # the key below the map


def test_balance_is_a_table(wide_map):
    page = render_html(wide_map)
    checks = section_of(page, "checks")
    assert "balance: share of each group" not in checks  # no longer bullet lines
    balance = checks.split('id="balance"')[1].split('id="training"')[0]
    shares = balance.split("<table")[1].split("</table>")[0]
    b = wide_map.checks["balance"]
    groups = [g for g in b["groups"] if any(b["norms"][t][g] > 0 for t in b["norms"])]
    header = re.findall(r"<th>(.*?)</th>", shares)
    assert header == ["term", *(f"<code>{g}</code>" for g in groups)]
    rows = re.findall(r"<tr>(.*?)</tr>", shares.split("<tbody>")[1])
    assert len(rows) == len(b["shares"]) == 3
    for row, (term, share) in zip(rows, b["shares"].items(), strict=True):
        cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
        assert cells[0] == f"<code>{term}</code>" and len(cells) == 1 + len(groups)
        want = [f"{100 * share[g]:.1f}%" if b["norms"][term][g] > 0 else "-" for g in groups]
        assert cells[1:] == want
    assert balance.count("<table") == 3  # shares, conflicts (cosines), one optimizer step per term
    assert "force vs virial" in balance and "cosine with the joint step" in balance


def test_training_curves_tell_every_variant_apart(wide_map):
    page = render_html(wide_map)
    training = section_of(page, "checks").split('id="training"')[1]
    figures = training.split("<figure")[1:]
    assert len(figures) == 3  # energy, force, virial
    styles: dict[str, set[tuple[str, str]]] = {}
    for fig in figures:
        for v in wide_map.variant_names[:3]:  # they train: a line each, in its own colour and dash
            line = re.search(rf'<polyline [^>]*data-variant="{re.escape(esc(v))}"', fig)
            assert line, v
            colour, dash = (
                re.search(rf'{k}="([^"]*)"', line.group()) for k in ("stroke", "stroke-dasharray")
            )
            styles.setdefault(v, set()).add((colour.group(1), dash.group(1) if dash else ""))
        # the failed variant: a labelled red x in the chart and the reason in the legend
        assert f'data-variant="{FAILING}" data-kind="failed"' in fig and f"{FAILING} failed</text>" in fig
        assert f"{FAILING}: failed after 1 value(s) — RuntimeError: torch.compile with aot_autograd" in fig
        assert f"{LONG}: decreases (same values as eager)" in fig  # identical curves are said to be
    assert all(len(s) == 1 for s in styles.values())  # one style per variant, the same in every chart
    assert len(set.union(*styles.values())) == 3  # and no two variants alike: colour and dash differ
    assert (
        len({c for s in styles.values() for c, _ in s})
        == len({d for s in styles.values() for _, d in s})
        == 3
    )
    widths = re.findall(r'<polyline [^>]*stroke-width="([\d.]+)"', figures[0])
    assert len(set(widths)) == 3  # coinciding curves nest: the first widest, the last on top narrowest


def test_norm_charts_show_every_variant(wide_map):
    norms = section_of(render_html(wide_map), "norms")
    charts = dict(re.findall(r"<figcaption>(.*?)</figcaption>(.*?)</figure>", norms))
    assert list(charts) == ["energy only", "force only", "virial only"]
    nparams = len(wide_map.trainable)
    for name, chart in charts.items():
        bars = {v: chart.count(f'data-variant="{esc(v)}" data-kind="bar"') for v in wide_map.variant_names}
        reached = {v: len(wide_map.reached(v, name)) for v in wide_map.variant_names[:3]}
        assert {v: bars[v] for v in reached} == reached
        assert (
            chart.count(f'data-variant="{FAILING}" data-kind="failed"') == nparams
        )  # grey dashed bars, not absent
        assert f"{FAILING}: run failed — backward RuntimeError" in chart
    # make_fx loses the hidden biases for force and virial: a red x where eager has a bar
    lost = re.findall(r'data-variant="make_fx" data-kind="missing"><title>(.*?) · ', charts["force only"])
    assert lost == ["fitting.layer1.bias", "fitting.layer2.bias"]
    assert 'data-variant="make_fx" data-kind="missing"' not in charts["energy only"]


# Run in the browser after layout: geometry of what the issue saw broken, written into the DOM.
LAYOUT_JS = """window.addEventListener('load',function(){
var bad=[],R=function(e){return e.getBoundingClientRect();};
function T(e){var r=document.createRange();r.selectNodeContents(e);return r.getBoundingClientRect();}
function cut(a,b){return a.left<b.right-1&&b.left<a.right-1&&a.top<b.bottom-1&&b.top<a.bottom-1;}
function inside(a,b){return a.left>=b.left-1&&a.right<=b.right+1&&a.top>=b.top-1&&a.bottom<=b.bottom+1;}
function name(e){return e.tagName+' '+(e.getAttribute('title')||e.textContent).slice(0,70);}
var heads=[].slice.call(document.querySelectorAll('#heatmap th.vname span'));
var scen=[].slice.call(document.querySelectorAll('#heatmap th.scen'));
heads.forEach(function(h,i){var a=T(h);
  if(!inside(a,R(h.parentElement)))bad.push('header outside its cell: '+name(h.parentElement));
  if(h.scrollHeight>h.clientHeight+1||h.scrollWidth>h.clientWidth+1)bad.push('header clipped: '+name(h));
  heads.slice(i+1).forEach(function(g){if(cut(a,T(g)))bad.push('headers overlap: '+name(h)+' / '+name(g));});
  scen.forEach(function(s){if(cut(a,T(s)))bad.push('header over a scenario title: '+name(h)+' / '+name(s));});});
document.querySelectorAll('th,td,li,h1,h2,h3,h4,figcaption,figure,section,.legend span,.verdict,.hm-wrap')
  .forEach(function(e){if(e.scrollWidth>e.clientWidth+1)bad.push('clipped or spilling: '+name(e));});
var figs=[].slice.call(document.querySelectorAll('figure'));
figs.forEach(function(f,i){figs.slice(i+1).forEach(function(g){if(cut(R(f),R(g)))
  bad.push('charts overlap: '+name(f.firstChild)+' / '+name(g.firstChild));});});
document.querySelectorAll('svg[role=img]').forEach(function(s){var b=R(s);s.querySelectorAll('text').forEach(
  function(t){if(!inside(R(t),b))bad.push('chart text outside its chart: '+t.textContent);});});
var out=document.createElement('pre');out.id='layout';out.textContent=JSON.stringify({width:innerWidth,
  height:document.documentElement.scrollHeight,headers:heads.length,scenarios:scen.length,
  header_height:heads.length?R(heads[0].parentElement).height:0,problems:bad});
document.body.appendChild(out);});"""


class Pre(HTMLParser):
    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.inside, self.text = False, ""
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.inside = self.inside or (tag == "pre" and ("id", "layout") in attrs)

    def handle_endtag(self, tag: str) -> None:
        self.inside = self.inside and tag != "pre"

    def handle_data(self, data: str) -> None:
        self.text += data if self.inside else ""


@pytest.mark.parametrize("width", [1280, 1920])
def test_in_chromium_layout_at_width(wide_map, eval_map, tmp_path, width):
    """The report as the issue's screenshots saw it, laid out by Chromium: headers fit their cells and
    overlap neither each other nor the scenario titles, no text is clipped, no chart overlaps another."""
    huge = "make_fx[detach=alias,tracing_mode=symbolic,pre_dispatch=true]+compile:aot_eager_decomp_partition"
    cases = [("wide", wide_map), ("huge-name", renamed(wide_map, LONG, huge))]
    cases += [("all-failed", eval_map)] * (width == 1280)  # one variant, every run failed
    for label, fm in cases:
        page = tmp_path / f"report-{label}.html"
        page.write_text(render_html(fm), encoding="utf-8")
        checked = tmp_path / f"report-{label}-layout.html"
        checked.write_text(page.read_text().replace("</body>", f"<script>{LAYOUT_JS}</script></body>"))
        dumped = browse(checked, tmp_path / f"profile-{label}", "--dump-dom", f"--window-size={width},1200")
        assert Dom(dumped).ids["heatmap"].get("data-ready") == "1"
        layout = json.loads(Pre(dumped).text)
        assert layout["width"] == width
        assert layout["headers"] == len(fm.variants) * len(fm.scenarios) and layout["scenarios"] == 4
        if fm is not eval_map:
            assert 150 < layout["header_height"] < 400  # grown to the longest name, no more
        assert layout["problems"] == [], layout["problems"]
        shot = tmp_path / f"report-{label}-{width}.png"
        height = min(layout["height"] + 40, 12000)
        browse(
            page,
            tmp_path / f"profile-shot-{label}",
            f"--screenshot={shot}",
            f"--window-size={width},{height}",
        )
        assert shot.stat().st_size > 50_000
        ARTIFACTS.mkdir(exist_ok=True)
        shutil.copy(shot, ARTIFACTS / shot.name)
        print(f"screenshot: {shot} (copy: {ARTIFACTS / shot.name})")


def test_curves_of_a_variant_that_never_ran_and_a_single_value(makefx_map):
    training = {
        "curves": {"eager": {"energy": [1.0]}, "broken": {"energy": []}, "nan": {"energy": ["nan", "nan"]}},
        "verdicts": {"eager": {"energy": "flat"}, "broken": {"energy": "error"}, "nan": {"energy": "error"}},
        "errors": {"broken": {"energy": "RuntimeError: build: boom"}},
    }
    fm = msgspec.structs.replace(makefx_map, checks={"training": training})
    page = render_html(fm)
    assert page == render_html(fm)  # deterministic
    chart = section_of(page, "checks").split('id="training"')[1]
    assert chart.count('data-kind="failed"') == 2  # an x for each, labelled, even with no point to end on
    assert "broken failed</text>" in chart and "nan failed</text>" in chart
    assert "broken: failed after 0 value(s) — RuntimeError: build: boom" in chart
    assert "nan: failed after 0 value(s) — the check marked it as an error" in chart
    assert "eager: flat" in chart and chart.count("<polyline") == 1  # one point: a marker on its line
    assert re.search(r'<circle cx="[\d.]+" cy="[\d.]+" r="4.0" fill="#2563eb"', chart)


# ----- issue 34: the first screen, the legend, the import machinery --------------------------------


@pytest.fixture(scope="module")
def six_errors_map(wide_map, eval_map, makefx_map) -> FlowMap:
    """Six error findings from four zoo bugs on the wide map, one of them twice (makefx-detach from
    the wide map and from the make_fx map: the same message), as a user with several bugs sees them."""
    nonfinite = gradprobe.probe(gradprobe.zoo.reference_spec(bug="nonfinite-grad"), progress=False)
    findings = (*wide_map.findings, *eval_map.findings, *nonfinite.findings, *makefx_map.findings)
    fm = msgspec.structs.replace(wide_map, findings=findings)
    assert sum(f.severity == "error" for f in fm.findings) == 6
    return fm


def test_first_screen_one_line_per_finding_duplicates_merged(six_errors_map):
    fm = six_errors_map
    page = render_html(fm)
    overview = page.split('id="overview"')[1].split("</ul>")[0]
    lines = re.findall(r'<li class="sev-(\w+)" data-cause="([^"]+)" data-count="(\d+)">', overview)
    causes = [f.cause for f in fm.findings]
    # the diagnosis order, each cause once: makefx-detach (twice in the map) and the identical
    # unused-parameter infos are merged
    assert [c for _, c, _ in lines] == list(dict.fromkeys(causes))
    assert causes.count("makefx-detach") == 2 and ("error", "makefx-detach", "2") in lines
    assert sum(int(n) for _, _, n in lines) == len(fm.findings)
    assert "PROBLEM: 6 error(s)" in Dom(page).all_text
    first = overview.split("</li>")[0]
    assert "the traced path drops second-order gradients (PyTorch #175477)" in first and "×2" in first
    assert "force only: 8/14" not in first  # one line: the details are below, linked
    assert 'href="#finding-0"' in first and 'id="finding-0"' in page
    assert page.index('id="overview"') < page.index('id="heatmap"') < page.index('id="findings"')


def test_merged_line_joins_the_paths(makefx_map):
    (f,) = [f for f in makefx_map.findings if f.cause == "makefx-detach"]
    other = msgspec.structs.replace(
        f,
        message=f.message.replace("in make_fx", "in make_fx[pre_dispatch=true]"),
        evidence={**f.evidence, "variant": "make_fx[pre_dispatch=true]"},
    )
    plain = msgspec.structs.replace(
        f, message="the traced path drops gradients in make_fx: x", evidence={**f.evidence}
    )
    plain2 = msgspec.structs.replace(
        f,
        message="the traced path drops gradients in make_fx+compile:eager: x",
        evidence={**f.evidence, "variant": "make_fx+compile:eager"},
    )
    from gradprobe.report.overview import finding_lines

    lines = finding_lines(msgspec.structs.replace(makefx_map, findings=(f, other, plain, plain2)))
    assert [len(x.indices) for x in lines] == [2, 2]
    assert lines[0].variants == ["make_fx", "make_fx[pre_dispatch=true]"]
    assert lines[1].text == "the traced path drops gradients in make_fx, make_fx+compile:eager"


# Written into the DOM after layout: where the first screen's parts are.
FIRST_SCREEN_JS = """window.addEventListener('load',function(){
var R=function(id){var e=document.getElementById(id);return e?e.getBoundingClientRect():null;};
var o=document.createElement('pre');o.id='layout';o.textContent=JSON.stringify({width:innerWidth,
height:innerHeight,verdict:R('verdict').top,overview:R('overview').bottom,heatmap:R('heatmap').top,
findings:R('findings').top});document.body.appendChild(o);});"""


@pytest.mark.parametrize("size", [(1400, 900), (800, 600)])
def test_in_chromium_heatmap_on_the_first_screen(six_errors_map, tmp_path, size):
    """With six errors, the verdict, a line per finding and the heat map's top edge are on the first
    screen (element positions after Chromium's layout, not pixels); the full findings come below."""
    width, height = size
    page = tmp_path / "report.html"
    page.write_text(
        render_html(six_errors_map).replace("</body>", f"<script>{FIRST_SCREEN_JS}</script></body>"),
        encoding="utf-8",
    )
    dumped = browse(page, tmp_path / "profile", "--dump-dom", f"--window-size={width},{height}")
    at = json.loads(Pre(dumped).text)
    assert at["width"] == width and 0 < at["height"] <= height
    assert 0 <= at["verdict"] < at["overview"] <= at["heatmap"], at
    assert at["heatmap"] + 30 <= at["height"], at  # its top edge, and a little of it, on the first screen
    assert at["findings"] > at["heatmap"], at


def test_training_legend_wraps_the_whole_error(makefx_map):
    why = "RuntimeError: " + " ".join(f"word{i}" for i in range(80)) + " the end"
    training = {
        "curves": {"eager": {"energy": [1.0, 0.5]}, "broken": {"energy": [1.0]}},
        "verdicts": {"eager": {"energy": "decreases"}, "broken": {"energy": "error"}},
        "errors": {"broken": {"energy": why}},
    }
    page = render_html(msgspec.structs.replace(makefx_map, checks={"training": training}))
    chart = section_of(page, "checks").split('id="training"')[1]
    assert f"broken: failed after 1 value(s) — {why}</span>" in chart and "…" not in chart
    css = page.split(".legend span{")[1].split("}")[0] if ".legend span{" in page else ""
    assert "nowrap" not in css


def test_import_machinery_is_never_a_where(makefx_map):
    (f,) = [f for f in makefx_map.findings if f.cause == "makefx-detach"]
    frozen = {"file": "<frozen importlib._bootstrap>", "line": 1140, "code": ""}
    page = render_html(
        msgspec.structs.replace(makefx_map, findings=(msgspec.structs.replace(f, location=frozen),))
    )
    assert "frozen importlib" not in page and "_bootstrap" not in page


def test_page_comes_from_the_autoescaped_template_shipped_in_the_package(evil_map):
    """The page is the Jinja2 template (package data: hatch ships every file under src/gradprobe in the
    wheel, and jinja2 is a core dependency); autoescaping writes user text as text."""
    import importlib.resources
    import tomllib

    from gradprobe.report.html import TEMPLATE, _template

    assert importlib.resources.files("gradprobe.report").joinpath("templates", TEMPLATE).is_file()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "jinja2>=3.1" in project["project"]["dependencies"]
    assert project["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == ["src/gradprobe"]
    template = _template()
    assert template.environment.autoescape is True and template.name == TEMPLATE
    page = render_html(evil_map)
    assert page.startswith("<!DOCTYPE html>\n") and page.count("<script>") == 1
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "&lt;img src=x onerror=" in page


# ----- compile events, tlparse-style --------------------------------------------------------------


class BreakingModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 3)
        self.b = torch.nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        print("", end="")  # a graph break: dynamo cannot trace print
        return self.b(h)


def breaking_step(model, batch):
    y = model(batch)
    return {"fit": y.pow(2).mean(), "reg": model.a.weight.abs().sum()}


def events_of(page: str) -> list[dict[str, str]]:
    """Each compile event of the page: its kind, summary and the text of its details."""
    section = section_of(page, "compile-events")
    found = re.findall(
        r'<details class="event" data-kind="([\w-]+)"><summary>(.*?)</summary>(.*?)</details>', section, re.S
    )
    strip = lambda h: " ".join(html.unescape(re.sub(r"<[^>]+>", " ", h)).split())  # noqa: E731
    return [{"kind": k, "summary": strip(s), "details": strip(d)} for k, s, d in found]


def test_graph_breaks_are_recorded_with_their_frame():
    fm = gradprobe.probe(
        gradprobe.ProbeSpec(model=BreakingModel(), step=breaking_step, batch=torch.ones(4, 3)),
        variants="eager,compile:eager",
        progress=False,
    )
    runs = fm.evidence["dynamo"]["compile:eager"]["runs"]
    breaks = [b for w in runs.values() for c in w["compiles"] for b in c.get("breaks") or ()]
    line = next(
        i for i, x in enumerate(Path(__file__).read_text().splitlines(), 1) if 'print("", end="")' in x
    )
    (inner,) = [b for b in breaks if b.get("function") == "forward"]
    assert (inner["file"], inner["line"]) == (__file__, line) and inner["code"].startswith(
        'print("", end="")'
    )
    assert inner["reason"].startswith("Failed to trace builtin operator") and "print" in inner["reason"]
    events = events_of(render_html(fm))
    (event,) = events  # one event: the frames the break went through are listed in its details
    assert event["kind"] == "graph-break" and "Failed to trace builtin operator" in event["summary"]
    assert f"test_report_html.py:{line} in forward" in event["summary"]
    assert 'print("", end="")' in event["details"] and "Hint:" in event["details"]
    assert (
        "also restarted: test_report_html.py" in event["details"] and "in breaking_step" in event["details"]
    )


def test_compile_events_expand_to_reason_and_frame(zoo_map):
    fm = zoo_map("recompile-per-scenario", diagnose=True)
    page = render_html(fm)
    events = events_of(page)
    kinds = {e["kind"] for e in events}
    assert {"graph-break", "recompile"} <= kinds
    recompile = next(e for e in events if e["kind"] == "recompile")
    assert "___stack" in recompile["summary"] and "multitask.py:" in recompile["summary"]
    assert "triggered by the following guard failure" in recompile["details"] or "==" in recompile["details"]
    brk = next(e for e in events if e["kind"] == "graph-break")
    assert "Tensor.item()" in brk["summary"] and "multitask.py:53 in flag_step" in brk["summary"]
    assert "capture_scalar_outputs" in brk["details"]
    # a compile that failed and a run that fell back to eager, as a map records them
    d = json.loads(fm.to_json())
    ev = d["evidence"]["dynamo"]["compile:aot_eager"]
    first = next(iter(ev["runs"]))
    ev["runs"][first]["compiles"].append(
        {"frame": "flag_step", "file": "/u/multitask.py", "line": 50, "ok": False, "fail_type": "InternalTorchDynamoError",
         "fail_reason": "NotImplementedError: len() of a <user object>", "graph_breaks": None, "reason": None, "breaks": []}
    )  # fmt: skip
    run = next(r for r in d["runs"] if r["variant"] == "compile:aot_eager" and r["scenario"] == first)
    run["error"] = {"stage": "forward", "type": "DynamoFallback", "message": "recompile_limit reached: ran in eager <b>",
                    "where": {"file": "/u/multitask.py", "line": 58, "code": "loss = w * e", "function": "flag_step"}}  # fmt: skip
    events = events_of(render_html(FlowMap.from_dict(d)))
    failed = next(e for e in events if e["kind"] == "failed-compile")
    assert "InternalTorchDynamoError: NotImplementedError: len() of a" in failed["summary"]
    assert "multitask.py:50 in flag_step" in failed["summary"]
    fallback = next(e for e in events if e["kind"] == "fallback")
    assert (
        "recompile_limit reached" in fallback["summary"]
        and "multitask.py:58 in flag_step" in fallback["summary"]
    )
    assert "loss = w * e" in fallback["details"]
    assert "ran in eager <b>" in Dom(render_html(FlowMap.from_dict(d))).all_text  # text, escaped


def test_in_chromium_compile_events_open(zoo_map, tmp_path):
    """In the browser each event is a closed <details> that opens to its reason and frame."""
    page = tmp_path / "events.html"
    js = """window.addEventListener('load',function(){var d=document.querySelectorAll('details.event');
    var h0=d[0].getBoundingClientRect().height;d[0].open=true;var h1=d[0].getBoundingClientRect().height;
    var o=document.createElement('pre');o.id='layout';o.textContent=JSON.stringify({n:d.length,closed:h0,open:h1});
    document.body.appendChild(o);});"""
    page.write_text(
        render_html(zoo_map("recompile-per-scenario")).replace("</body>", f"<script>{js}</script></body>")
    )
    at = json.loads(Pre(browse(page, tmp_path / "profile", "--dump-dom", "--window-size=1400,900")).text)
    assert at["n"] >= 2 and at["open"] > at["closed"] + 20, at
