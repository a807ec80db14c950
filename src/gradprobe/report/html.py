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

from ..flowmap import Finding, FlowMap, Run
from .controls import visible
from .terminal import _cell_text, check_lines, interpretation_lines, meaning_lines, variant_lines, verdict

SYMBOL = {"nan": "N", "inf": "∞", "zero": "0", "failed": "×", "wrong": "≠", "missing": "−", "extra": "+"}
LEGEND = (
    ("nonzero", "non-zero gradient"), ("zero", "exactly zero"), ("none", "no gradient (None)"),
    ("nan", "NaN"), ("inf", "infinity"), ("failed", "run failed"),
    ("wrong", "wrong value vs reference"), ("missing", "missing vs reference"), ("extra", "extra vs reference"),
)  # fmt: skip
PALETTE = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be185d", "#4d7c0f")
BARS = ("#2563eb", "#0d9488", "#7c3aed", "#ca8a04", "#db2777")

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
.grid th{background:#f9fafb;font-weight:600}.num{text-align:right;font-variant-numeric:tabular-nums}.bad{color:#b91c1c;font-weight:600}
.hm-wrap{overflow-x:auto}.heatmap th,.heatmap td{padding:0}.first{border-left:3px solid #fff}.frozen{color:#9ca3af}
.heatmap .pname{padding:1px 12px 1px 0;font:12.5px ui-monospace,monospace;white-space:nowrap}
.heatmap .scen{text-align:center;padding:2px 3px;border-bottom:1px solid #d1d5db;border-left:3px solid #fff;font-size:12.5px}
.heatmap .vname{vertical-align:bottom;padding:4px 0;font-weight:400;font-size:12px}
.heatmap .vname span{writing-mode:vertical-rl;transform:rotate(180deg);display:inline-block;max-height:190px}
.hm-cell{width:var(--cw);min-width:var(--cw);height:22px;text-align:center;font-size:12px;font-weight:700;color:#fff;border:1px solid #fff}
.hm-cell:hover{outline:2px solid #111827}#hm-info{min-height:22px;font-size:13px;margin:6px 0;color:#374151}
.k-nonzero{background:#16a34a}.k-zero{background:#93c5fd;color:#1e3a8a}.k-none{background:#e5e7eb}.k-nan{background:#7f1d1d}
.k-inf{background:#c2410c}.k-failed{background:repeating-linear-gradient(45deg,#6b7280 0 4px,#9ca3af 4px 8px)}
.k-wrong{background:#f59e0b;color:#451a03}.k-missing{background:#dc2626}.k-extra{background:#7c3aed}
.k-absent{background:#fff;border:1px dashed #9ca3af}.dash{background:repeating-linear-gradient(90deg,var(--c) 0 5px,#fff 5px 8px)!important}
.legend{display:flex;flex-wrap:wrap;gap:6px 18px;margin-top:10px;font-size:13px}
.legend span.sw{display:inline-block;width:16px;height:14px;margin-right:5px;vertical-align:-2px;font-size:10px;text-align:center;
color:#fff;font-weight:700;line-height:14px}.charts{display:flex;flex-wrap:wrap;gap:18px}figure{margin:0}
figcaption{font-weight:600;margin-bottom:4px}svg text{font:11px system-ui,sans-serif;fill:#374151}svg .nf{fill:#b91c1c}li.in{margin-left:18px}
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
        f'<header><h1>gradprobe report</h1><div class="sub">{esc(facts)}</div>'
        f'<div class="verdict v-{kind}" id="verdict">{esc(text)}</div></header>'
    )


def _location(loc: dict[str, Any] | None) -> str:
    if not loc:
        return ""
    if "file" not in loc:
        modules = loc.get("modules")
        return f"<dt>where</dt><dd>{esc(', '.join(map(str, modules)))}</dd>" if modules else ""
    where = f"{os.path.basename(str(loc['file']))}:{loc.get('line', '?')}"
    module = f" in {loc['module'] or 'the root module'}" if loc.get("module") is not None else ""
    mtype = f" ({loc['module_type']})" if loc.get("module_type") else ""
    code = f"<pre>{esc(loc['code'])}</pre>" if loc.get("code") else ""
    return f'<dt>where</dt><dd><code title="{esc(loc["file"])}">{esc(where)}</code>{esc(module + mtype)}{code}</dd>'


def _finding(f: Finding) -> str:
    parts = [_location(f.location)]
    parts += [f"<dt>fix</dt><dd>{esc(f.fix)}</dd>"] * bool(f.fix)
    parts += [f"<dt>see</dt><dd>{esc(', '.join(f.references))}</dd>"] * bool(f.references)
    return (
        f'<div class="finding sev-{esc(f.severity)}"><span class="badge">{esc(f.severity.upper())}</span> '
        f"<code>{esc(f.cause)}</code><p>{esc(f.message)}</p><dl>{''.join(parts)}</dl></div>"
    )


def _findings(fm: FlowMap) -> str:
    content = "".join(_finding(f) for f in fm.findings) or '<p class="hint">No finding.</p>'
    return _section("Findings", content, "findings")


# ----- summary table and diff ------------------------------------------------------------------


def _summary(fm: FlowMap) -> str:
    rows = []
    for s in fm.scenario_names:
        cells = []
        for v in fm.variant_names:
            text, differs = _cell_text(fm, v, s) if _run(fm, v, s) else ("no run", True)
            text = text.removesuffix(" !") + (" ⚠" if text.endswith(" !") else "")
            cells.append(f'<td class="num{" bad" * differs}">{esc(text)}</td>')
        rows.append([esc(s), *cells])
    rtol = f", rtol {fm.rtol:g}" if fm.rtol is not None else ""
    note = f"; ⚠ = differs from {fm.reference} in reach or value{rtol}" if len(fm.variants) > 1 else ""
    interp = "".join(f"<li>{esc(line)}</li>" for line in interpretation_lines(fm))
    return _section(
        "Parameters reached per scenario",
        f'<p class="hint">non-zero gradient / trainable{esc(note)}</p>'
        + _table(["scenario", *map(esc, fm.variant_names)], rows)
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
                header = ["parameter", esc(fm.reference), esc(v), "L1 ref", "L1", "rel. error", "verdict"]
                blocks.append(f"<h3>{esc(s)}: {esc(fm.reference)} vs {esc(v)}</h3>" + _table(header, rows))
    return _section("Per-parameter diff", "".join(blocks) or '<p class="hint">No cell differs.</p>', "diff")


# ----- heat map --------------------------------------------------------------------------------


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
    names = "".join(
        f'<th class="vname{" first" * (i == 0)}"><span>{esc(v)}</span></th>'
        for _ in fm.scenarios
        for i, v in enumerate(fm.variant_names)
    )
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
        f'<div class="legend">{legend}</div>',
        "heatmap-section",
    )


# ----- charts ----------------------------------------------------------------------------------


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


def _norm_chart(fm: FlowMap, scenario: str, lo: int, hi: int, colour: str) -> str:
    """Bars of log10 L1 norm per trainable parameter in model order (zero/none left empty)."""
    cells, params = fm.cells_of(fm.reference, scenario), fm.trainable
    bw, left, top, ph, bottom = 24, 46, 10, 150, 130
    w, y = left + bw * len(params) + 10, (lambda k: top + ph * (1 - (k - lo) / (hi - lo)))
    parts = [_y_axis(lo, hi, left, w - 6, y)]
    for i, p in enumerate(params):
        c, x = cells.get(p), left + i * bw
        mid = x + bw / 2
        status, norm = (c.status, c.norm) if c else ("absent", None)
        tip = esc(f"{p}: {status}, L1 norm {_num(norm, '.4g')}")
        if status == "nonzero" and norm and norm > 0:
            yt = y(math.log10(norm))
            parts.append(
                f'<rect x="{x + 3}" y="{yt:.1f}" width="{bw - 6}" height="{top + ph - yt:.1f}" '
                f'fill="{colour}"><title>{tip}</title></rect>'
            )
        elif status in ("nan", "inf"):
            parts.append(f'<text x="{mid}" y="{top + 12}" class="nf" text-anchor="middle">{status}</text>')
        short = p if len(p) <= 26 else "…" + p[-25:]
        parts.append(
            f'<text transform="translate({mid + 4},{top + ph + 8}) rotate(-55)" text-anchor="end">'
            f"<title>{tip}</title>{esc(short)}</text>"
        )
    parts.append(f'<line x1="{left}" x2="{w - 6}" y1="{top + ph}" y2="{top + ph}" stroke="#6b7280"/>')
    svg = f'<svg width="{w}" height="{top + ph + bottom}" role="img">{"".join(parts)}</svg>'
    return f"<figure><figcaption>{esc(scenario)} ({esc(fm.reference)})</figcaption>{svg}</figure>"


def _norm_charts(fm: FlowMap) -> str:
    singles = [s for s in fm.scenarios if len(s.terms) == 1]
    ok = [s.name for s in singles if (r := _run(fm, fm.reference, s.name)) and r.error is None]
    if not singles:
        return ""
    norms = [c.norm for s in ok for c in fm.cells_of(fm.reference, s).values() if c.norm is not None]
    lo, hi = _log_range(norms)
    charts = [_norm_chart(fm, s, lo, hi, BARS[i % len(BARS)]) for i, s in enumerate(ok)]
    failed = "".join(f"<li>{esc(s.name)}: the reference run failed</li>" for s in singles if s.name not in ok)
    return _section(
        "Gradient flow per term: log10 L1 norm per parameter, in model order",
        f'<div class="charts">{"".join(charts)}</div>' + (f"<ul>{failed}</ul>" if failed else ""),
        "norms",
    )


def _floats(xs: Any) -> list[float | None]:
    out: list[float | None] = []
    for x in xs if isinstance(xs, list | tuple) else ():
        ok = (isinstance(x, int | float) and not isinstance(x, bool)) or x in ("nan", "inf", "-inf")
        out.append(float(x) if ok else None)
    return out


def _curve_chart(term: str, series: dict[str, list[float | None]]) -> str:
    """Polylines of each variant's loss curve on a log scale; gaps where a value is not positive."""
    values = [x for xs in series.values() for x in xs if x is not None]
    lo, hi = _log_range(values)
    n = max((len(xs) for xs in series.values()), default=1)
    left, top, pw, ph = 46, 10, 320, 160
    y = lambda k: top + ph * (1 - (k - lo) / (hi - lo))  # noqa: E731
    steps = f'<text x="{left}" y="{top + ph + 15}">step 0</text><text x="{left + pw}" y="{top + ph + 15}"'
    parts, legend = [_y_axis(lo, hi, left, left + pw, y), f'{steps} text-anchor="end">{n - 1}</text>'], []
    for i, (v, xs) in enumerate(series.items()):
        colour, segs, seg = PALETTE[i % len(PALETTE)], [], []
        dash = ' stroke-dasharray="7 4"' * (i > 0)  # later variants dashed: identical curves stay visible
        for j, x in enumerate(xs):
            if x is not None and x > 0 and math.isfinite(x):
                seg.append(f"{left + pw * j / max(n - 1, 1):.1f},{y(math.log10(x)):.1f}")
            elif seg:
                segs, seg = [*segs, seg], []
        for pts in (p for p in [*segs, seg] if p):
            parts.append(
                f'<polyline fill="none" stroke="{colour}" stroke-width="2"{dash} points="{" ".join(pts)}"/>'
            )
        swatch = f'<span class="sw{" dash" * (i > 0)}" style="background:{colour};--c:{colour}"></span>'
        legend.append(f"<span>{swatch}{esc(v)}</span>")
    svg = f'<svg width="{left + pw + 10}" height="{top + ph + 20}" role="img">{"".join(parts)}</svg>'
    return f'<figure><figcaption>{esc(term)}</figcaption>{svg}<div class="legend">{"".join(legend)}</div></figure>'


def _curves(check: dict[str, Any]) -> str:
    """Loss curves of the training check, one chart per term, when it recorded ``curves``."""
    curves, verdicts = check.get("curves"), check.get("verdicts")
    by_term: dict[str, dict[str, list[float | None]]] = {}
    for v, terms in curves.items() if isinstance(curves, dict) else ():
        said = verdicts.get(v) if isinstance(verdicts, dict) and isinstance(verdicts.get(v), dict) else {}
        for t, xs in terms.items() if isinstance(terms, dict) else ():
            by_term.setdefault(str(t), {})[f"{v}: {said[t]}" if t in said else str(v)] = _floats(xs)
    charts = "".join(_curve_chart(t, series) for t, series in by_term.items())
    head = "<h3>Training: loss per term (log scale)</h3>"
    return f'{head}<div class="charts" id="training">{charts}</div>' if charts else ""


def _checks(fm: FlowMap) -> str:
    """Verification checks: the terminal's check lines, and the training loss curves."""
    try:
        lines = check_lines(fm)
    except (KeyError, TypeError, AttributeError, ValueError):  # a checks dict of another shape: curves only
        lines = []
    training = fm.checks.get("training")
    charts = _curves(training) if isinstance(training, dict) else ""
    items = "".join(f'<li class="{"in" * x.startswith(" ")}">{esc(x.strip())}</li>' for x in lines)
    content = (f"<ul>{items}</ul>" if items else "") + charts
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
        [f"<code>{esc(v.name)}</code>", esc(", ".join(f"{k}={x}" for k, x in v.knobs.items()) or "-"),
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
    sections = (_header, _findings, _summary, _heatmap, _norm_charts, _checks, _diffs, _environment)
    body = "".join(section(fm) for section in sections)
    return visible(
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>gradprobe: {esc(verdict(fm))}</title><style>{CSS}</style></head>"
        f"<body><main>{body}</main><script>{JS}</script></body></html>\n"
    )
