"""One self-contained HTML file: verdict and findings, the summary table, a heat map of every
(parameter, scenario, variant) cell, gradient-norm charts per term, training curves, environment.

No network at view time: CSS, SVG and a few lines of JS are inline, fonts are the system's. Every
user-derived string (names, messages, paths, code) goes through ``esc`` (what ``html.escape`` does),
also inside attributes; the heat-map tooltips are escaped ``title`` attributes that the JS only copies
as text.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import msgspec

from ..flowmap import Finding, FlowMap, Run
from ..frames import is_import_machinery
from .controls import visible
from .overview import finding_lines
from .terminal import (
    cell_text,
    check_lines,
    interpretation_lines,
    meaning_lines,
    trial_rows,
    variant_lines,
    verdict,
)

SYMBOL = {"nan": "N", "inf": "∞", "zero": "0", "failed": "×", "wrong": "≠", "missing": "−", "extra": "+"}
LEGEND = (
    ("nonzero", "non-zero gradient"), ("zero", "exactly zero"), ("none", "no gradient (None)"),
    ("nan", "NaN"), ("inf", "infinity"), ("failed", "run failed"),
    ("wrong", "wrong value vs reference"), ("missing", "missing vs reference"), ("extra", "extra vs reference"),
)  # fmt: skip
# One style per variant, the same in every chart: a colour (red is kept for failures), a dash pattern
# and a marker, so that curves or bars that coincide stay distinguishable, also in greyscale.
PALETTE = ("#2563eb", "#ea580c", "#16a34a", "#9333ea", "#0891b2", "#be185d", "#4d7c0f", "#854d0e")
DASHES = ("", "8 4", "2 3", "10 3 2 3", "5 2", "1 3", "12 3 3 3", "4 4")
MARKERS = ("circle", "square", "triangle", "diamond", "down", "plus")
FAIL = "#b91c1c"
HEADER_CHARS = 44  # a longer variant name is shortened in the heat map's column header (full name on hover)

CSS = """
*{box-sizing:border-box}body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1f2937;margin:0;background:#f3f4f6}
main{max-width:1360px;margin:0 auto;padding:20px 28px}h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:0 0 10px}
section{background:#fff;border:1px solid #e5e7eb;border-radius:8px;padding:16px 20px;margin:14px 0}.sub,.hint{color:#6b7280;font-size:13px}
.verdict{display:inline-block;font-weight:600;font-size:16px;padding:6px 14px;border-radius:6px;margin:8px 0}
.v-error{background:#fee2e2;color:#991b1b}.v-warning{background:#fef3c7;color:#92400e}.v-ok{background:#dcfce7;color:#166534}
.finding{border-left:5px solid #9ca3af;padding:8px 14px;margin:10px 0;background:#f9fafb;border-radius:4px}.finding p{margin:6px 0}
.sev-error{border-color:#dc2626}.sev-warning{border-color:#f59e0b}.sev-info{border-color:#60a5fa}
.badge{font-size:11px;font-weight:700;padding:2px 7px;border-radius:4px;color:#fff;background:#6b7280}
.sev-error .badge{background:#dc2626}.sev-warning .badge{background:#d97706}.sev-info .badge{background:#3b82f6}
dl{display:grid;grid-template-columns:70px 1fr;gap:3px 10px;margin:6px 0}dt{color:#6b7280;font-weight:600}dd{margin:0}
pre{margin:4px 0 0;padding:6px 9px;background:#111827;color:#e5e7eb;border-radius:4px;white-space:pre-wrap;font-size:12.5px}
code{font:12.5px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}ul{margin:8px 0;padding-left:20px}
table{border-collapse:collapse}td,th{padding:4px 10px;text-align:left}.grid td,.grid th{border-bottom:1px solid #e5e7eb}
.grid th{background:#f9fafb;font-weight:600}h3,.sub{overflow-wrap:anywhere}.num{text-align:right;font-variant-numeric:tabular-nums}.bad{color:#b91c1c;font-weight:600}
.hm-wrap{overflow-x:auto}.heatmap th,.heatmap td{padding:0}.first{border-left:3px solid #fff}.frozen{color:#9ca3af}
.heatmap .pname{padding:1px 12px 1px 0;font:12.5px ui-monospace,monospace;white-space:nowrap}
.heatmap .scen{text-align:center;padding:2px 3px;border-bottom:1px solid #d1d5db;border-left:3px solid #fff;font-size:12.5px;overflow-wrap:anywhere}
.heatmap .vname{vertical-align:bottom;text-align:center;padding:6px 0 4px;font-weight:400;font-size:12px}
.heatmap .vname span{writing-mode:vertical-rl;transform:rotate(180deg);display:inline-block;white-space:nowrap;line-height:1.25}
.hm-cell{width:var(--cw);min-width:var(--cw);height:22px;text-align:center;font-size:12px;font-weight:700;color:#fff;border:1px solid #fff}
.hm-cell:hover{outline:2px solid #111827}#hm-info{min-height:22px;font-size:13px;margin:6px 0;color:#374151}
.k-nonzero{background:#16a34a}.k-zero{background:#93c5fd;color:#1e3a8a}.k-none{background:#e5e7eb}.k-nan{background:#7f1d1d}
.k-inf{background:#c2410c}.k-failed{background:repeating-linear-gradient(45deg,#6b7280 0 4px,#9ca3af 4px 8px)}
.k-wrong{background:#f59e0b;color:#451a03}.k-missing{background:#dc2626}.k-extra{background:#7c3aed}
.k-absent{background:#fff;border:1px dashed #9ca3af}.dash{background:repeating-linear-gradient(90deg,var(--c) 0 5px,#fff 5px 8px)!important}
.legend{display:flex;flex-wrap:wrap;gap:6px 18px;margin-top:10px;font-size:13px}
.legend span.sw{display:inline-block;width:16px;height:14px;margin-right:5px;vertical-align:-2px;font-size:10px;text-align:center;
color:#fff;font-weight:700;line-height:14px}.charts{display:flex;flex-wrap:wrap;gap:18px 28px;align-items:flex-start}
figure{margin:0;max-width:100%;overflow-x:auto}figure .legend{margin-top:4px;gap:3px 14px;font-size:12.5px}
.legend svg{vertical-align:-2px;margin-right:5px;flex:none}.legend.rows{flex-direction:column}.legend.rows>span{display:flex;align-items:baseline}.legend .failed,.failed{color:#b91c1c}.legend span{overflow-wrap:anywhere}
figcaption{font-weight:600;margin-bottom:4px}svg text{font:11px system-ui,sans-serif;fill:#374151}svg .nf{fill:#b91c1c}li.in{margin-left:18px}
.overview{list-style:none;padding:0;margin:2px 0 0}.overview li{margin:2px 0;font-size:13.5px;line-height:1.4;overflow-wrap:anywhere}
.overview a{text-decoration:none}.overview .times{color:#6b7280;font-weight:600}.overview .badge{font-size:10px;padding:1px 5px}
header .top{display:flex;flex-wrap:wrap;align-items:center;gap:4px 18px}header h1{margin:0}
header .verdict{margin:2px 0}#heatmap-section{padding-top:10px}#heatmap-section h2{display:inline;margin-right:14px}
#heatmap-section #hm-info{display:inline-block;margin:0 0 6px}.share{min-width:72px}.balance h4{margin:12px 0 4px;font-size:13.5px}.key{margin:4px 0;font-size:12.5px;color:#374151}
"""

JS = """(function(){var hm=document.getElementById('heatmap'),info=document.getElementById('hm-info');
if(!hm)return;hm.addEventListener('mouseover',function(e){var c=e.target.closest('.hm-cell');
if(c)info.textContent=c.getAttribute('title').split('\\n').join('  \\u00b7  ');});hm.dataset.ready='1';})();"""


# html.escape(quote=True) as one pass of str.translate: the heat map escapes a name per cell.
_ESCAPES = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#x27;"})


def esc(x: object) -> str:
    """HTML-escaped text, safe in element content and in quoted attributes."""
    return str(x).translate(_ESCAPES)


def _num(x: float | None, fmt: str = ".3g") -> str:
    if x is None:
        return "-"
    return str(x) if math.isnan(x) or math.isinf(x) else format(x, fmt)


def _run(fm: FlowMap, variant: str, scenario: str) -> Run | None:
    return next((r for r in fm.runs if r.variant == variant and r.scenario == scenario), None)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], cls: str = "grid") -> str:
    """A table from already-escaped cells; a cell starting with '<td' is used as is."""
    head = f"<thead><tr>{''.join(f'<th>{h}</th>' for h in header)}</tr></thead>" if header else ""
    body = "".join(
        "<tr>" + "".join(c if c.startswith("<td") else f"<td>{c}</td>" for c in r) + "</tr>" for r in rows
    )
    return f'<table class="{cls}">{head}<tbody>{body}</tbody></table>'


def _section(title: str, content: str, sid: str) -> str:
    return f'<section id="{sid}"><h2>{title}</h2>{content}</section>'


# ----- verdict and findings -------------------------------------------------------------------


def _header(fm: FlowMap) -> str:
    text = verdict(fm)
    kind = "error" if fm.errors() else ("warning" if text.startswith("check") else "ok")
    facts = f"{fm.device} {fm.dtype} · torch {fm.torch_version} · reference {fm.reference}"
    facts += " · variants: " + ", ".join(fm.variant_names)
    return (
        f'<header><div class="top"><h1>gradprobe report</h1><div class="verdict v-{kind}" id="verdict">'
        f'{esc(text)}</div></div><div class="sub">{esc(facts)}</div></header>'
    )


def _overview(fm: FlowMap) -> str:
    """The first screen under the verdict: one line per finding in the diagnosis order, duplicates
    merged, each a link to its details below."""
    items = []
    for line in finding_lines(fm):
        times = f' <span class="times">×{len(line.indices)}</span>' if len(line.indices) > 1 else ""
        items.append(
            f'<li class="sev-{esc(line.severity)}" data-cause="{esc(line.cause)}" data-count="{len(line.indices)}">'
            f'<span class="badge">{esc(line.severity.upper())}</span> <a href="#finding-{line.indices[0]}">'
            f"<code>{esc(line.cause)}</code></a> {esc(line.text)}{times}</li>"
        )
    return f'<ul id="overview" class="overview">{"".join(items)}</ul>' if items else ""


def _location(loc: dict[str, Any] | None) -> str:
    if not loc or is_import_machinery(str(loc.get("file", ""))):
        return ""
    if "file" not in loc:
        modules = loc.get("modules")
        return f"<dt>where</dt><dd>{esc(', '.join(map(str, modules)))}</dd>" if modules else ""
    where = f"{os.path.basename(str(loc['file']))}:{loc.get('line', '?')}"
    module = f" in {loc['module'] or 'the root module'}" if loc.get("module") is not None else ""
    mtype = f" ({loc['module_type']})" if loc.get("module_type") else ""
    code = f"<pre>{esc(loc['code'])}</pre>" if loc.get("code") else ""
    return f'<dt>where</dt><dd><code title="{esc(loc["file"])}">{esc(where)}</code>{esc(module + mtype)}{code}</dd>'


def _finding(f: Finding, i: int) -> str:
    parts = [_location(f.location)]
    parts += [f"<dt>fix</dt><dd>{esc(f.fix)}</dd>"] * bool(f.fix)
    parts += [f"<dt>see</dt><dd>{esc(', '.join(f.references))}</dd>"] * bool(f.references)
    return (
        f'<div class="finding sev-{esc(f.severity)}" id="finding-{i}"><span class="badge">{esc(f.severity.upper())}</span> '
        f"<code>{esc(f.cause)}</code><p>{esc(f.message)}</p><dl>{''.join(parts)}</dl></div>"
    )


def _findings(fm: FlowMap) -> str:
    content = "".join(_finding(f, i) for i, f in enumerate(fm.findings)) or '<p class="hint">No finding.</p>'
    return _section("Findings", content, "findings")


# ----- summary table and diff ------------------------------------------------------------------


def _summary(fm: FlowMap) -> str:
    rows = []
    for s in fm.scenario_names:
        cells = []
        for v in fm.variant_names:
            text, differs = cell_text(fm, v, s) if _run(fm, v, s) else ("no run", True)
            text = text.removesuffix(" !") + (" ⚠" if text.endswith(" !") else "")
            cells.append(f'<td class="num{" bad" * differs}">{esc(text)}</td>')
        rows.append([esc(s), *cells])
    rtol = f", rtol {fm.rtol:g}" if fm.rtol is not None else ""
    note = f"; ⚠ = differs from {fm.reference} in reach or value{rtol}" if len(fm.variants) > 1 else ""
    interp = "".join(f"<li>{esc(line)}</li>" for line in interpretation_lines(fm))
    return _section(
        "Parameters reached per scenario",
        f'<p class="hint">non-zero gradient / trainable{esc(note)}</p>'
        + _table(["scenario", *map(_breakable, fm.variant_names)], rows)
        + (f"<ul>{interp}</ul>" if interp else ""),
        "summary",
    )


def _diffs(fm: FlowMap) -> str:
    if len(fm.variants) < 2:
        return ""
    blocks = []
    for v in fm.variant_names:
        for s in fm.scenario_names:
            diffs = fm.differences(v, s) if v != fm.reference else {}
            ref = fm.cells_of(fm.reference, s)
            rows = [
                [f"<code>{esc(p)}</code>", esc(ref[p].status if p in ref else "-"), esc(c.status),
                 f'<td class="num">{_num(ref[p].norm if p in ref else None)}</td>',
                 f'<td class="num">{_num(c.norm)}</td>', f'<td class="num">{_num(c.rel_error)}</td>',
                 f'<td class="bad">{esc(c.verdict)}</td>']
                for p, c in diffs.items()
            ]  # fmt: skip
            if rows:
                header = [
                    "parameter",
                    _breakable(fm.reference),
                    _breakable(v),
                    "L1 ref",
                    "L1",
                    "rel. error",
                    "verdict",
                ]
                blocks.append(
                    f"<h3>{esc(s)}: {_breakable(fm.reference)} vs {_breakable(v)}</h3>" + _table(header, rows)
                )
    return _section("Per-parameter diff", "".join(blocks) or '<p class="hint">No cell differs.</p>', "diff")


def _trials(fm: FlowMap) -> str:
    """The trial table of each bisection: flip, result, seconds."""
    blocks = [
        f"<h3>{_breakable(variant)}" + (f" (on {esc(scenarios)})" if scenarios else "") + "</h3>"
        + _table(
            ["flip", "result", "seconds"],
            [[esc(flip), f'<td class="{"" if result.startswith("matches") else "bad"}">{esc(result)}</td>',
              f'<td class="num">{esc(sec)}</td>'] for flip, result, sec in rows],
        )
        for variant, scenarios, rows in trial_rows(fm)
    ]  # fmt: skip
    return _section("Bisection trials", "".join(blocks), "trials") if blocks else ""


# ----- heat map --------------------------------------------------------------------------------


def _breakable(name: str) -> str:
    """``name`` escaped, with a line-break opportunity after each ``+ , [ :`` (a variant name has no
    space: in a table header it would otherwise widen its column past the page)."""
    out = esc(name)
    for c in "+,[:":
        out = out.replace(c, c + "<wbr>")
    return out


def _short(name: str, limit: int = HEADER_CHARS) -> str:
    """``name`` shortened in the middle to ``limit`` characters (start and end tell variants apart)."""
    if len(name) <= limit:
        return name
    head = (limit - 1) // 2
    return name[:head] + "…" + name[len(name) - (limit - 1 - head) :]


def _cell_attrs(fm: FlowMap, v: str, s: str, p: str) -> tuple[str, str, str, list[str]]:
    """(status, verdict, colour kind, tooltip lines) of one heat-map cell."""
    run = _run(fm, v, s)
    tip = [f"parameter: {p}", f"scenario: {s}", f"variant: {v}"]
    if run is None or run.error is not None:
        err = run.error if run else fm.variant(v).error
        why = f"{err.stage} {err.type}: {err.message}" if err else "no run recorded"
        return "failed", "", "failed", [*tip, "status: failed", f"error: {why}"]
    cell = fm.cells_of(v, s).get(p)
    if cell is None:
        return "absent", "", "absent", [*tip, "status: absent (no cell recorded)"]
    vd = cell.verdict or ""
    kind = vd if vd in ("wrong", "missing", "extra") else cell.status
    tip += [
        f"status: {cell.status}",
        f"L1 norm: {_num(cell.norm, '.4g')}",
        f"rel. error: {_num(cell.rel_error)}",
    ]
    return cell.status, vd, kind, [*tip, f"verdict: {vd or ('reference' if v == fm.reference else '-')}"]


def _heatmap(fm: FlowMap) -> str:
    nv = len(fm.variants)
    top = "".join(f'<th class="scen" colspan="{nv}">{esc(s)}</th>' for s in fm.scenario_names)
    # Vertical text without wrapping: the header row is as tall as the longest (shortened) name, so a
    # name can neither spill over the scenario titles above nor into the next column.
    names = "".join(
        f'<th class="vname{" first" * (i == 0)}" title="{esc(v)}"><span>{esc(_short(v))}</span></th>'
        for _ in fm.scenarios
        for i, v in enumerate(fm.variant_names)
    )
    shortened = [v for v in fm.variant_names if _short(v) != v]
    key = "".join(f"<li><code>{esc(_short(v))}</code> = <code>{esc(v)}</code></li>" for v in shortened)
    rows = []
    for p in fm.parameters:
        label = esc(p.name) + ("" if p.requires_grad else ' <span class="frozen">(frozen)</span>')
        tds = []
        for s in fm.scenario_names:
            for i, v in enumerate(fm.variant_names):
                status, vd, kind, tip = _cell_attrs(fm, v, s, p.name)
                tds.append(
                    f'<td class="hm-cell k-{esc(kind)}{" first" * (i == 0)}" data-parameter="{esc(p.name)}" '
                    f'data-scenario="{esc(s)}" data-variant="{esc(v)}" data-status="{esc(status)}" '
                    f'data-verdict="{esc(vd)}" title="{esc(chr(10).join(tip))}">{SYMBOL.get(kind, "")}</td>'
                )
        rows.append(f'<tr><th class="pname" title="{esc(p.name)}">{label}</th>{"".join(tds)}</tr>')
    legend = "".join(
        f'<span><span class="sw k-{k}">{SYMBOL.get(k, "")}</span>{esc(text)}</span>' for k, text in LEGEND
    )
    return _section(
        "Heat map: gradient status per parameter, scenario and variant",
        '<div id="hm-info" class="hint">Hover a cell for its details.</div><div class="hm-wrap">'
        f'<table id="heatmap" class="heatmap" style="--cw:{max(30, 60 // nv)}px"><thead><tr><th rowspan="2"></th>'
        f"{top}</tr><tr>{names}</tr></thead><tbody>{''.join(rows)}</tbody></table></div>"
        f'<div class="legend">{legend}</div>'
        + (f'<div class="key">shortened column names:<ul>{key}</ul></div>' if key else ""),
        "heatmap-section",
    )


# ----- charts ----------------------------------------------------------------------------------


def _styles(names: Sequence[str]) -> dict[str, tuple[str, str, str]]:
    """(colour, dash pattern, marker) of each variant, by its place in ``names``."""
    return {
        v: (PALETTE[i % len(PALETTE)], DASHES[i % len(DASHES)], MARKERS[i % len(MARKERS)])
        for i, v in enumerate(names)
    }


def _marker(shape: str, x: float, y: float, r: float, colour: str, extra: str = "") -> str:
    """One point marker of ``shape`` centred on (x, y); ``extra`` is inserted as attributes."""
    if shape == "circle":
        return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{r:.1f}" fill="{colour}"{extra}/>'
    if shape == "square":
        a = r * 0.9
        return f'<rect x="{x - a:.1f}" y="{y - a:.1f}" width="{2 * a:.1f}" height="{2 * a:.1f}" fill="{colour}"{extra}/>'
    if shape == "plus":
        d = f"M{x - r:.1f} {y:.1f}H{x + r:.1f}M{x:.1f} {y - r:.1f}V{y + r:.1f}"
        return f'<path d="{d}" stroke="{colour}" stroke-width="{max(r * 0.7, 1.5):.1f}"{extra}/>'
    a = r * 1.15
    corners = {
        "triangle": ((x, y - a), (x - a, y + a * 0.75), (x + a, y + a * 0.75)),
        "down": ((x, y + a), (x - a, y - a * 0.75), (x + a, y - a * 0.75)),
        "diamond": ((x, y - a), (x + r, y), (x, y + a), (x - r, y)),
    }[shape]
    points = " ".join(f"{px:.1f},{py:.1f}" for px, py in corners)
    return f'<polygon points="{points}" fill="{colour}"{extra}/>'


def _cross(x: float, y: float, r: float, colour: str = FAIL, width: float = 2.0) -> str:
    """An x drawn with lines (failed or missing), centred on (x, y)."""
    d = f"M{x - r:.1f} {y - r:.1f}L{x + r:.1f} {y + r:.1f}M{x - r:.1f} {y + r:.1f}L{x + r:.1f} {y - r:.1f}"
    return f'<path d="{d}" stroke="{colour}" stroke-width="{width:g}" fill="none"/>'


def _swatch(style: tuple[str, str, str], line: bool = True) -> str:
    """A legend swatch: the variant's line (with its dash pattern) and marker, or a bar of its colour."""
    colour, dash, shape = style
    if not line:
        return f'<svg width="14" height="12" aria-hidden="true"><rect x="2" y="0" width="10" height="12" fill="{colour}"/></svg>'
    dashes = f' stroke-dasharray="{dash}"' if dash else ""
    return (
        f'<svg width="34" height="12" aria-hidden="true"><line x1="1" x2="33" y1="6" y2="6" stroke="{colour}" '
        f'stroke-width="2"{dashes}/>{_marker(shape, 17, 6, 3.5, colour)}</svg>'
    )


def _failed_swatch() -> str:
    return f'<svg width="14" height="12" aria-hidden="true">{_cross(7, 6, 4.5)}</svg>'


def _failed_bar(x: float, y: float, w: float, h: float, extra: str = "") -> str:
    """A run that failed, where its bar would be: a grey bar of the plot's full height, outlined in dashes
    (no pattern: a ``url(#...)`` fill would be the page's only ``url(``)."""
    return (
        f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:g}" height="{h:g}" fill="#b8bec8" stroke="#374151" '
        f'stroke-width="1" stroke-dasharray="2 2"{extra}'
    )


def _failed_bar_swatch() -> str:
    return f'<svg width="14" height="12" aria-hidden="true">{_failed_bar(3.5, 0.5, 7, 11)}/></svg>'


def _log_range(values: list[float]) -> tuple[int, int]:
    logs = [math.log10(x) for x in values if x > 0 and math.isfinite(x)]
    lo, hi = (math.floor(min(logs)), math.ceil(max(logs))) if logs else (0, 1)
    return lo, max(hi, lo + 1)


def _y_axis(lo: int, hi: int, x0: int, x1: int, y: Any) -> str:
    """Horizontal grid lines and labels at powers of ten."""
    step = max(1, math.ceil((hi - lo) / 8))
    return "".join(
        f'<line x1="{x0}" x2="{x1}" y1="{y(k):.1f}" y2="{y(k):.1f}" stroke="#e5e7eb"/>'
        f'<text x="{x0 - 4}" y="{y(k) + 4:.1f}" text-anchor="end">1e{k}</text>'
        for k in range(lo, hi + 1, step)
    )


def _why(err: Any) -> str:
    return f"{err.stage} {err.type}: {err.message}" if err else "no run recorded"


def _norm_chart(fm: FlowMap, scenario: str, lo: int, hi: int) -> str:
    """Grouped bars of log10 L1 norm per trainable parameter in model order, one bar per variant: a run
    that failed is a grey dashed bar, a gradient the reference has and a variant lost is a red x."""
    params, names, styles = fm.trainable, fm.variant_names, _styles(fm.variant_names)
    nv = len(names)
    slot = max(4, min(18, 28 // nv))  # one bar's width
    gw, left, top, ph, bottom = slot * nv + 6, 46, 14, 150, 130
    w, y = left + gw * len(params) + 10, (lambda k: top + ph * (1 - (k - lo) / (hi - lo)))
    base = top + ph
    failed = {}
    cells = {}
    for v in names:
        run = _run(fm, v, scenario)
        if run is None or run.error is not None:
            failed[v] = _why(run.error if run else fm.variant(v).error)
        else:
            cells[v] = fm.cells_of(v, scenario)
    parts = [_y_axis(lo, hi, left, w - 6, y)]
    for i, p in enumerate(params):
        x0 = left + i * gw + 3
        for k, v in enumerate(names):
            x = x0 + k * slot
            mid = x + slot / 2
            if v in failed:
                tip = esc(f"{p} · {v}: run failed — {failed[v]}")
                extra = f' data-variant="{esc(v)}" data-kind="failed"'
                parts.append(f"{_failed_bar(x + 0.5, top, slot - 2, ph, extra)}><title>{tip}</title></rect>")
                continue
            c = cells[v].get(p)
            status, norm, vd = (c.status, c.norm, c.verdict or "") if c else ("absent", None, "")
            said = f", {vd} vs {fm.reference}" if vd and vd != "match" else ""
            tip = esc(f"{p} · {v}: {status}, L1 norm {_num(norm, '.4g')}{said}")
            if status == "nonzero" and norm and norm > 0:
                yt = min(y(math.log10(norm)), base - 1)
                outline = f' stroke="{FAIL}" stroke-width="1.5"' if vd == "wrong" else ""
                parts.append(
                    f'<rect x="{x:.1f}" y="{yt:.1f}" width="{slot - 1}" height="{base - yt:.1f}" '
                    f'fill="{styles[v][0]}"{outline} data-variant="{esc(v)}" data-kind="bar"><title>{tip}</title></rect>'
                )
            elif status in ("nan", "inf"):
                parts.append(
                    f'<text x="{mid:.1f}" y="{top + 10}" class="nf" text-anchor="middle" data-variant="{esc(v)}" '
                    f'data-kind="{status}"><title>{tip}</title>{SYMBOL[status]}</text>'
                )
            elif vd == "missing" or status == "absent":
                r = 3.5
                parts.append(
                    f'<g data-variant="{esc(v)}" data-kind="missing"><title>{tip}</title>'
                    f"{_cross(mid - 0.5, base - r - 2, r, FAIL, 2)}</g>"
                )
        centre = left + i * gw + gw / 2
        short = p if len(p) <= 26 else "…" + p[-25:]
        parts.append(
            f'<text transform="translate({centre + 4:.1f},{base + 8}) rotate(-55)" text-anchor="end">'
            f"<title>{esc(p)}</title>{esc(short)}</text>"
        )
    parts.append(f'<line x1="{left}" x2="{w - 6}" y1="{base}" y2="{base}" stroke="#6b7280"/>')
    svg = f'<svg width="{w}" height="{base + bottom}" role="img">{"".join(parts)}</svg>'
    notes = "".join(
        f'<span class="failed" title="{esc(why)}">{_failed_bar_swatch()}{esc(v)}: run failed — {esc(why)}</span>'
        for v, why in failed.items()
    )
    legend = f'<div class="legend">{notes}</div>' if notes else ""
    return f'<figure style="max-width:{w}px"><figcaption>{esc(scenario)}</figcaption>{svg}{legend}</figure>'


def _norm_charts(fm: FlowMap) -> str:
    singles = [s.name for s in fm.scenarios if len(s.terms) == 1]
    if not singles:
        return ""
    norms = [
        c.norm
        for v in fm.variant_names
        for s in singles
        if (r := _run(fm, v, s)) and r.error is None
        for c in fm.cells_of(v, s).values()
        if c.norm is not None
    ]
    lo, hi = _log_range(norms)
    charts = [_norm_chart(fm, s, lo, hi) for s in singles]
    styles = _styles(fm.variant_names)
    key = [f"<span>{_swatch(styles[v], line=False)}{esc(v)}</span>" for v in fm.variant_names]
    if len(fm.variants) > 1:
        key.append(
            f"<span>{_failed_swatch()}gradient lost: {esc(fm.reference)} has one, this variant none</span>"
        )
        key.append(f'<span><svg width="14" height="12" aria-hidden="true"><rect x="2" y="1" width="10" height="10" '
                   f'fill="#fff" stroke="{FAIL}" stroke-width="1.5"/></svg>wrong value vs {esc(fm.reference)}</span>')  # fmt: skip
    if any((r := _run(fm, v, s)) is None or r.error is not None for v in fm.variant_names for s in singles):
        key.append(f"<span>{_failed_bar_swatch()}run failed</span>")
    key.append("<span>N / ∞: NaN / infinite gradient; an empty slot: no gradient</span>")
    return _section(
        "Gradient flow per term: log10 L1 norm per parameter, in model order",
        f'<div class="legend" style="margin:0 0 10px">{"".join(key)}</div><div class="charts">{"".join(charts)}</div>',
        "norms",
    )


def _floats(xs: Any) -> list[float | None]:
    out: list[float | None] = []
    for x in xs if isinstance(xs, list | tuple) else ():
        ok = (isinstance(x, int | float) and not isinstance(x, bool)) or x in ("nan", "inf", "-inf")
        out.append(float(x) if ok else None)
    return out


def _curve_axis(values: list[float]) -> tuple[float, float, list[tuple[float, str]]]:
    """(log10 low, log10 high, ticks) of a loss chart: decades over a wide range; 1, 2, 5 times a power
    of ten (or finer) over a narrow one, so that a slowly decreasing curve is not a flat line."""
    logs = [math.log10(x) for x in values if x > 0 and math.isfinite(x)]
    if not logs or max(logs) - min(logs) >= 3:
        lo, hi = _log_range(values)
        step = max(1, math.ceil((hi - lo) / 8))
        return lo, hi, [(k, f"1e{k}") for k in range(lo, hi + 1, step)]
    a, b = min(logs), max(logs)
    for mantissas in ((1, 2, 5), (1, 1.5, 2, 3, 4, 5, 6, 7, 8, 9), tuple(1 + i / 10 for i in range(90))):
        nice = [math.log10(m) + k for k in range(math.floor(a) - 1, math.ceil(b) + 1) for m in mantissas]
        low = max((t for t in nice if t <= a + 1e-12), default=a)
        high = min((t for t in nice if t >= b - 1e-12), default=b)
        ticks = [t for t in nice if low - 1e-12 <= t <= high + 1e-12]
        if len(ticks) >= 3 or mantissas[-1] > 10:
            break
    if high - low < 1e-9:  # one value: a decade around it
        low, high = low - 0.5, high + 0.5
        ticks = [low, (low + high) / 2, high]
    if len(ticks) > 9:
        ticks = ticks[:: math.ceil(len(ticks) / 8)]
    return low, high, [(t, f"{10**t:.3g}") for t in ticks]


def _curve_chart(
    term: str, series: list[tuple[str, list[float | None], str, str | None]], styles: Any
) -> str:
    """Each variant's loss curve on a log scale, in its colour, dash pattern and marker; gaps where a value
    is not positive. Curves that coincide on screen are drawn wider underneath and their markers side by
    side, so each stays visible; a variant that failed ends in a red x labelled "failed" (at the top left
    when it has no value at all), and its legend entry says why."""
    values = [x for _, xs, _, _ in series for x in xs if x is not None]
    lo, hi, ticks = _curve_axis(values)
    n = max((len(xs) for _, xs, _, _ in series), default=1)
    left, top, pw, ph = 52, 10, 340, 160
    y = lambda k: top + ph * (1 - (k - lo) / (hi - lo))  # noqa: E731
    parts = [
        f'<line x1="{left}" x2="{left + pw}" y1="{y(t):.1f}" y2="{y(t):.1f}" stroke="#e5e7eb"/>'
        f'<text x="{left - 4}" y="{y(t) + 4:.1f}" text-anchor="end">{label}</text>'
        for t, label in ticks
    ]
    parts.append(
        f'<text x="{left}" y="{top + ph + 15}">step 0</text>'
        f'<text x="{left + pw}" y="{top + ph + 15}" text-anchor="end">{n - 1}</text>'
    )
    points = [
        {j: (left + 12 + (pw - 24) * j / max(n - 1, 1), y(math.log10(x))) for j, x in enumerate(xs)
         if x is not None and x > 0 and math.isfinite(x)}
        for _, xs, _, _ in series
    ]  # fmt: skip

    def coincide(a: dict[int, tuple[float, float]], b: dict[int, tuple[float, float]]) -> bool:
        return bool(a) and bool(b) and all(abs(a[j][1] - b[j][1]) < 3 for j in a.keys() & b.keys())

    ns, legend, fails = len(series), [], []
    for i, (v, xs, said, error) in enumerate(series):
        colour, dash, shape = styles(v)
        under = sum(len(points[j]) > 1 and coincide(points[i], points[j]) for j in range(i + 1, ns))
        crowded = any(coincide(points[i], points[j]) for j in range(ns) if j != i)
        width, r = 2 + 2.5 * under, 4.0
        dx = (i - (ns - 1) / 2) * min(6.0, 36 / ns) if crowded else 0.0
        dashes = f' stroke-dasharray="{dash}"' if dash else ""
        segs, seg = [], []
        for j in range(len(xs)):
            if j in points[i]:
                seg.append("{:.1f},{:.1f}".format(*points[i][j]))
            elif seg:
                segs, seg = [*segs, seg], []
        for pts in (p for p in [*segs, seg] if p):
            parts.append(
                f'<polyline fill="none" stroke="{colour}" stroke-width="{width:g}"{dashes} '
                f'points="{" ".join(pts)}" data-variant="{esc(v)}"/>'
            )
        parts.extend(
            _marker(shape, px + dx, py, r, colour, ' stroke="#fff" stroke-width="0.8"')
            for px, py in points[i].values()
        )
        same = next((series[j][0] for j in range(i) if series[j][1] == xs and xs), None)
        tail = f" (same values as {same})" if same else ""
        swatch = _swatch((colour, dash, shape))
        if error is not None or said == "error":
            px, py = points[i][max(points[i])] if points[i] else (left + 8, top + 8)
            ly = py - 9 - 13 * len(fails)
            anchor = "end" if px > left + pw / 2 else "start"
            lx = px - 9 if anchor == "end" else px + 9
            fails.append(
                f'<g data-variant="{esc(v)}" data-kind="failed">{_cross(px + dx, py, 5.5)}<text x="{lx:.1f}" '
                f'y="{max(ly, top + 9):.1f}" class="nf" text-anchor="{anchor}">{esc(_short(v, 30))} failed</text></g>'
            )
            why = error or "the check marked it as an error"
            label = f"{v}: failed after {len(points[i])} value(s) — {why}"
            legend.append(f'<span class="failed">{swatch}<span>{esc(label)}</span></span>')
        else:
            text = f"{v}: {said}" if said else v
            legend.append(f"<span>{swatch}<span>{esc(text + tail)}</span></span>")
    w = left + pw + 12
    svg = f'<svg width="{w}" height="{top + ph + 20}" role="img">{"".join(parts + fails)}</svg>'
    return (
        f'<figure style="max-width:{max(w, 420)}px"><figcaption>{esc(term)}</figcaption>{svg}'
        f'<div class="legend rows">{"".join(legend)}</div></figure>'
    )


def _curves(check: dict[str, Any], variants: Sequence[str] = ()) -> str:
    """Loss curves of the training check, one chart per term, when it recorded ``curves``."""
    curves, verdicts, errors = check.get("curves"), check.get("verdicts"), check.get("errors")
    by_term: dict[str, list[tuple[str, list[float | None], str, str | None]]] = {}
    names = list(variants)
    for v, terms in curves.items() if isinstance(curves, dict) else ():
        said = verdicts.get(v) if isinstance(verdicts, dict) and isinstance(verdicts.get(v), dict) else {}
        why = errors.get(v) if isinstance(errors, dict) and isinstance(errors.get(v), dict) else {}
        names += [str(v)] * (str(v) not in names)
        for t, xs in terms.items() if isinstance(terms, dict) else ():
            error = str(why[t]) if t in why else None
            by_term.setdefault(str(t), []).append((str(v), _floats(xs), str(said.get(t, "")), error))
    styles = _styles(names)
    charts = "".join(_curve_chart(t, series, styles.__getitem__) for t, series in by_term.items())
    head = "<h3>Training: loss per term (log scale)</h3>"
    return f'{head}<div class="charts" id="training">{charts}</div>' if charts else ""


def _balance(b: Any) -> str:
    """The balance check as tables: each group's gradient norm shared out by term, the conflicting
    pairs, and one optimizer step per term against the joint one."""
    if not isinstance(b, dict) or b.get("error"):
        return ""
    try:
        groups = [g for g in b["groups"] if any(b["norms"][t][g] > 0 for t in b["norms"])]
        drowned = {(d["term"], d["group"]): d for d in b.get("dominated") or ()}
        rows = []
        for term, shares in b["shares"].items():
            cells = [f"<code>{esc(term)}</code>"]
            for g in groups:
                norm = b["norms"][term][g]
                if norm <= 0:
                    cells.append('<td class="num share">-</td>')
                    continue
                d, pct = drowned.get((term, g)), 100 * shares[g]
                note = f"; drowned by {d['by']}" if d else ""
                bar = f"background:linear-gradient(#60a5fa,#60a5fa) no-repeat left bottom/{pct:.1f}% 4px"
                cells.append(
                    f'<td class="num share{" bad" * bool(d)}" style="{bar}" '
                    f'title="{esc(f"{term} in {g}: L1 norm {norm:.4g}, {pct:.1f}% of the group{note}")}">'
                    f"{pct:.1f}%</td>"
                )
            rows.append(cells)
        parts = [
            "<h4>Share of each group's gradient norm, by term (at the step's prefactors)</h4>",
            _table(["term", *(f"<code>{esc(g)}</code>" for g in groups)], rows),
        ]
        conflicts = b.get("conflicts") or []
        if conflicts:
            cgroups = sorted({g for c in conflicts for g in c.get("groups", {})}, key=groups.index)
            crow = [
                [esc(" vs ".join(map(str, c["terms"]))),
                 f'<td class="num{" bad" * (c["cosine"] < 0)}">{c["cosine"]:.2f}</td>',
                 *(f'<td class="num">{c["groups"][g]:.2f}</td>' if g in c.get("groups", {}) else "-" for g in cgroups)]
                for c in conflicts
            ]  # fmt: skip
            parts += [
                "<h4>Cosine between the terms' gradients (negative: they pull apart)</h4>",
                _table(["terms", "all", *(f"<code>{esc(g)}</code>" for g in cgroups)], crow),
            ]
        update = b.get("effective_update") or {}
        if update.get("terms"):
            urows = [
                [f"<code>{esc(t)}</code>", f'<td class="num">{u["cosine_with_joint"]:.2f}</td>',
                 f'<td class="num">{_num(u.get("norm_alone"))}</td>', f'<td class="num">{_num(u.get("norm_joint"))}</td>']
                for t, u in update["terms"].items()
            ]  # fmt: skip
            parts += [
                f"<h4>One {esc(update.get('optimizer', ''))} step: each term alone vs all together</h4>",
                _table(["term", "cosine with the joint step", "|step| alone", "|step| joint"], urows),
            ]
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError):
        return ""  # a balance dict of another shape: its lines stay in the list above
    errors = "".join(
        f"<li>balance ({esc(part)}): could not run — {esc(error)}</li>"
        for part, error in (b.get("errors") or {}).items()
    )
    return (
        '<div class="balance" id="balance"><h3>Balance</h3>'
        + "".join(parts)
        + (f"<ul>{errors}</ul>" if errors else "")
        + "</div>"
    )


def _checks(fm: FlowMap) -> str:
    """Verification checks: the terminal's check lines, the balance tables and the training curves."""
    balance = _balance(fm.checks.get("balance"))
    rest = {k: x for k, x in fm.checks.items() if k != "balance"} if balance else fm.checks
    try:
        lines = check_lines(msgspec.structs.replace(fm, checks=rest) if balance else fm)
    except (KeyError, TypeError, AttributeError, ValueError):  # a checks dict of another shape: curves only
        lines = []
    training = fm.checks.get("training")
    charts = _curves(training, fm.variant_names) if isinstance(training, dict) else ""
    items = "".join(f'<li class="{"in" * x.startswith(" ")}">{esc(x.strip())}</li>' for x in lines)
    content = (f"<ul>{items}</ul>" if items else "") + balance + charts
    return _section("Checks", content, "checks") if content else ""


# ----- environment and page --------------------------------------------------------------------


def _environment(fm: FlowMap) -> str:
    facts = [
        ("gradprobe", fm.gradprobe_version), ("torch", fm.torch_version), ("device", fm.device),
        ("dtype", fm.dtype), ("step contract", fm.mode), ("terms", ", ".join(fm.terms)),
        ("reference", fm.reference), ("rtol", _num(fm.rtol, "g")),
    ]  # fmt: skip
    kv = _table([], [[f"<b>{esc(k)}</b>", esc(x)] for k, x in facts])
    rows = [
        [f"<code>{_breakable(v.name)}</code>", esc(", ".join(f"{k}={x}" for k, x in v.knobs.items()) or "-"),
         esc(v.capture), esc(v.backend or "-"), esc(_num(v.compile_count, "g")), esc(_num(v.graphs, "g")),
         esc(_num(v.graph_breaks, "g")), f"{v.seconds:.1f}s",
         esc(f"{v.error.stage} {v.error.type}: {v.error.message}" if v.error else "-")]
        for v in fm.variants
    ]  # fmt: skip
    header = ["variant", "knobs", "capture", "backend", "compiled", "graphs", "breaks", "time", "build error"]
    lines = variant_lines(fm) + meaning_lines(fm) + [f"warning: {w}" for w in fm.warnings]
    return _section(
        "Environment and variants",
        kv + "<br>" + _table(header, rows) + "<ul>" + "".join(f"<li>{esc(x)}</li>" for x in lines) + "</ul>",
        "environment",
    )


def render_html(fm: FlowMap) -> str:
    """The whole report as one self-contained HTML page."""
    # The first screen: the verdict, one line per finding, the heat map; the details below.
    sections = (
        _header, _overview, _heatmap, _findings, _summary, _norm_charts, _checks, _trials, _diffs, _environment,
    )  # fmt: skip
    body = "".join(section(fm) for section in sections)
    return visible(
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>gradprobe: {esc(verdict(fm))}</title><style>{CSS}</style></head>"
        f"<body><main>{body}</main><script>{JS}</script></body></html>\n"
    )
