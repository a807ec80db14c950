"""One self-contained HTML file: the verdict, a line per finding and a heat map of every (parameter,
scenario, variant) cell on the first screen; then the findings in full, the summary table, gradient-norm
charts per term, checks and training curves, bisection trials, the per-parameter diff, environment.

The page comes from a Jinja2 template (``templates/report.html.j2``) with autoescaping: this module
only gathers plain data (strings, numbers, lists, and SVG elements as ``{tag, attrs, title, text,
kids}``), and the template writes every value as text, in element content and in quoted attributes
alike. No network at view time: CSS, SVG and a few lines of JS are inline, fonts are the system's; the
heat-map tooltips are escaped ``title`` attributes that the JS only copies as text.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from typing import Any

import jinja2
import markupsafe
import msgspec
from jinja2.ext import Extension

from ..flowmap import FlowMap, Run
from ..frames import is_import_machinery, is_user_file
from .controls import visible
from .overview import finding_lines
from .terminal import (
    cell_text,
    check_lines,
    dynamo_facts,
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
TEMPLATE = "report.html.j2"


def esc(x: object) -> str:
    """HTML-escaped text, as the template's autoescaping writes it (in content and quoted attributes)."""
    return str(markupsafe.escape(str(x)))


class _JoinLines(Extension):
    """The template's source lines joined, each without its indentation: the page gets no whitespace
    from the template's layout (data keeps its own newlines: code, tooltips)."""

    def preprocess(self, source: str, name: str | None, filename: str | None = None) -> str:
        return "".join(line.lstrip() for line in source.splitlines())


def _breakable(name: str) -> list[str]:
    """``name`` in pieces, split after each ``+ , [ :``: the template puts a line-break opportunity
    (``<wbr>``) between them (a variant name has no space: in a table header it would otherwise widen
    its column past the page)."""
    parts, start = [], 0
    for i, c in enumerate(name):
        if c in "+,[:":
            parts.append(name[start : i + 1])
            start = i + 1
    return [*parts, name[start:]]


@functools.cache
def _template() -> jinja2.Template:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("gradprobe.report", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        extensions=[_JoinLines],
    )
    env.filters["breakable"] = _breakable
    return env.get_template(TEMPLATE)


def _num(x: float | None, fmt: str = ".3g") -> str:
    if x is None:
        return "-"
    return str(x) if math.isnan(x) or math.isinf(x) else format(x, fmt)


def _run(fm: FlowMap, variant: str, scenario: str) -> Run | None:
    return next((r for r in fm.runs if r.variant == variant and r.scenario == scenario), None)


def _c(t: object, cls: str = "", **kw: Any) -> dict[str, Any]:
    """A table cell: its text and, optionally, class, style, title, and whether it is code, bold or a
    name to break at ``+ , [ :``."""
    return {"t": str(t), "cls": cls, "style": kw.get("style"), "title": kw.get("title"),
            "code": kw.get("code", False), "b": kw.get("b", False), "wbr": kw.get("wbr", False)}  # fmt: skip


def _table(header: Sequence[Any], rows: Sequence[Sequence[Any]], cls: str = "grid") -> dict[str, Any]:
    """A table; a plain string is a cell of that text."""

    def cell(x: Any) -> dict[str, Any]:
        return x if isinstance(x, dict) else _c(x)

    return {"cls": cls, "header": [cell(h) for h in header], "rows": [[cell(x) for x in r] for r in rows]}


def _e(tag: str, *kids: dict[str, Any], title: str | None = None, text: str | None = None, **attrs: Any):
    """An SVG element for the template's ``el`` macro; ``stroke_width=`` is written ``stroke-width``,
    ``class_=`` ``class``; ``None`` attributes are left out."""
    pairs = [(k.rstrip("_").replace("_", "-"), str(v)) for k, v in attrs.items() if v is not None]
    return {"tag": tag, "attrs": pairs, "title": title, "text": text, "kids": list(kids)}


# ----- verdict and findings -------------------------------------------------------------------


def _header(fm: FlowMap) -> dict[str, Any]:
    text = verdict(fm)
    kind = "error" if fm.errors() else ("warning" if text.startswith("check") else "ok")
    facts = f"{fm.device} {fm.dtype} · torch {fm.torch_version} · reference {fm.reference}"
    facts += " · variants: " + ", ".join(fm.variant_names)
    return {"verdict": text, "kind": kind, "facts": facts}


def _overview(fm: FlowMap) -> list[dict[str, Any]]:
    """One line per finding in the diagnosis order, duplicates merged, each a link to its details."""
    return [
        {
            "severity": x.severity,
            "cause": x.cause,
            "text": x.text,
            "count": len(x.indices),
            "first": x.indices[0],
        }
        for x in finding_lines(fm)
    ]


def _location(loc: dict[str, Any] | None) -> dict[str, Any] | None:
    if not loc or is_import_machinery(str(loc.get("file", ""))):
        return None
    if "file" not in loc:
        modules = loc.get("modules")
        return {"modules": ", ".join(map(str, modules))} if modules else None
    module = f" in {loc['module'] or 'the root module'}" if loc.get("module") is not None else ""
    mtype = f" ({loc['module_type']})" if loc.get("module_type") else ""
    return {
        "file": str(loc["file"]),
        "short": f"{os.path.basename(str(loc['file']))}:{loc.get('line', '?')}",
        "module": module + mtype,
        "code": str(loc.get("code") or ""),
        "modules": "",
    }


def _findings(fm: FlowMap) -> list[dict[str, Any]]:
    return [
        {"severity": f.severity, "cause": f.cause, "message": f.message, "where": _location(f.location),
         "fix": f.fix, "references": ", ".join(f.references)}
        for f in fm.findings
    ]  # fmt: skip


# ----- summary table and diff ------------------------------------------------------------------


def _summary(fm: FlowMap) -> dict[str, Any]:
    rows = []
    for s in fm.scenario_names:
        cells = [_c(s)]
        for v in fm.variant_names:
            text, differs = cell_text(fm, v, s) if _run(fm, v, s) else ("no run", True)
            text = text.removesuffix(" !") + (" ⚠" if text.endswith(" !") else "")
            cells.append(_c(text, "num bad" if differs else "num"))
        rows.append(cells)
    rtol = f", rtol {fm.rtol:g}" if fm.rtol is not None else ""
    note = f"; ⚠ = differs from {fm.reference} in reach or value{rtol}" if len(fm.variants) > 1 else ""
    header = ["scenario", *(_c(v, wbr=True) for v in fm.variant_names)]
    return {"note": note, "table": _table(header, rows), "interpretation": interpretation_lines(fm)}


def _diffs(fm: FlowMap) -> list[dict[str, Any]] | None:
    if len(fm.variants) < 2:
        return None
    blocks = []
    for v in fm.variant_names:
        for s in fm.scenario_names:
            diffs = fm.differences(v, s) if v != fm.reference else {}
            ref = fm.cells_of(fm.reference, s)
            rows = [
                [_c(p, code=True), ref[p].status if p in ref else "-", c.status,
                 _c(_num(ref[p].norm if p in ref else None), "num"), _c(_num(c.norm), "num"),
                 _c(_num(c.rel_error), "num"), _c(c.verdict, "bad")]
                for p, c in diffs.items()
            ]  # fmt: skip
            if rows:
                header = ["parameter", _c(fm.reference, wbr=True), _c(v, wbr=True), "L1 ref", "L1",
                          "rel. error", "verdict"]  # fmt: skip
                blocks.append(
                    {"scenario": s, "reference": fm.reference, "variant": v, "table": _table(header, rows)}
                )
    return blocks


def _trials(fm: FlowMap) -> list[dict[str, Any]]:
    """The trial table of each bisection: flip, result, seconds."""
    return [
        {"variant": variant, "scenarios": scenarios, "table": _table(
            ["flip", "result", "seconds"],
            [[flip, _c(result, "" if result.startswith("matches") else "bad"), _c(sec, "num")]
             for flip, result, sec in rows])}
        for variant, scenarios, rows in trial_rows(fm)
    ]  # fmt: skip


# ----- compile events ----------------------------------------------------------------------------


def _at(file: Any, line: Any, function: Any = None) -> str:
    where = f"{os.path.basename(str(file))}:{line if line is not None else '?'}"
    return where + (f" in {function}" if function else "")


def _first_line(text: Any) -> str:
    return str(text or "").strip().split("\n", 1)[0]


def _variant_events(fm: FlowMap, variant: str) -> list[dict[str, Any]]:
    """Each compile event of one path, tlparse-style: graph breaks (one per reason and run, at the
    innermost user frame that broke, the frames it broke through listed), recompiles (the failed guard
    and its line), compiles that failed, and runs that fell back to eager."""
    d = (fm.evidence.get("dynamo") or {}).get(variant) or {}
    windows = [("build", d.get("build")), *(d.get("runs") or {}).items()]
    out: list[dict[str, Any]] = []
    for name, w in windows:
        if not isinstance(w, dict):
            continue
        compiles = [c for c in w.get("compiles") or () if isinstance(c, dict) and c.get("frame")]
        breaks: dict[str, list[dict[str, Any]]] = {}
        for c in compiles:
            for b in c.get("breaks") or ():
                breaks.setdefault(str(b.get("reason", "")), []).append(b)
        for reason, sites in breaks.items():
            user = [b for b in sites if b.get("file") and is_user_file(str(b["file"]))] or sites
            b = user[-1]  # the innermost: dynamo restarts every frame the break went through
            at = _at(b.get("file"), b.get("line"), b.get("function"))
            through = [_at(x.get("file"), x.get("line"), x.get("function")) for x in user[:-1]]
            through = [x for x in dict.fromkeys(through) if x != at]
            out.append({
                "kind": "graph-break", "label": "graph break", "window": name, "summary": _first_line(reason),
                "frame": at, "file": str(b.get("file") or ""),
                "code": str(b.get("code") or ""),
                "reason": reason + (f"\n\nalso restarted: {', '.join(through)}" if through else ""),
            })  # fmt: skip
        if not breaks:  # a map from before the breaks were recorded per frame: dynamo's reasons alone
            for reason, n in (w.get("graph_breaks") or {}).items():
                out.append({"kind": "graph-break", "label": "graph break", "window": name, "frame": "",
                            "file": "", "code": "", "summary": f"{_first_line(reason)} (×{n})",
                            "reason": str(reason)})  # fmt: skip
        for c in compiles:
            r = c.get("reason")
            if isinstance(r, dict):
                out.append({
                    "kind": "recompile", "label": "recompile", "window": name,
                    "summary": f"{r.get('guard') or 'a guard failed'} (frame {c['frame']})",
                    "frame": _at(r["file"], r.get("line")) if r.get("file") else _at(c.get("file"), c.get("line"), c["frame"]),
                    "file": str(r.get("file") or c.get("file") or ""), "code": str(r.get("code") or ""),
                    "reason": str(r.get("text") or ""),
                })  # fmt: skip
            if c.get("fail_type"):
                out.append({
                    "kind": "failed-compile", "label": "compile failed", "window": name,
                    "summary": f"{c['fail_type']}: {_first_line(c.get('fail_reason'))}",
                    "frame": _at(c.get("file"), c.get("line"), c["frame"]), "file": str(c.get("file") or ""),
                    "code": "", "reason": str(c.get("fail_reason") or ""),
                })  # fmt: skip
    compiled = any(isinstance(w, dict) and w.get("ran_compiled") for _, w in windows)
    for name, w in (d.get("runs") or {}).items():
        run = _run(fm, variant, name)
        err = run.error if run is not None else None
        if err is not None and err.type == "DynamoFallback":
            where = err.where or {}
            out.append({
                "kind": "fallback", "label": "fallback to eager", "window": name, "summary": _first_line(err.message),
                "frame": _at(where["file"], where.get("line"), where.get("function")) if where.get("file") else "",
                "file": str(where.get("file") or ""), "code": str(where.get("code") or ""), "reason": err.message,
            })  # fmt: skip
        elif compiled and isinstance(w, dict) and not w.get("ran_compiled") and err is None:
            out.append({"kind": "fallback", "label": "ran eager", "window": name, "frame": "", "file": "",
                        "code": "", "summary": "no compiled code ran in this run: dynamo ran it in eager",
                        "reason": ""})  # fmt: skip
    return out


def _events(fm: FlowMap) -> list[dict[str, Any]]:
    """The compile events of every path dynamo compiled, each expandable to its reason and frame."""
    blocks = []
    for v in fm.variant_names:
        events, facts = _variant_events(fm, v), dynamo_facts(fm, v)
        if events:
            blocks.append({"variant": v, "facts": facts, "events": events})
    return blocks


# ----- heat map --------------------------------------------------------------------------------


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


def _heatmap(fm: FlowMap) -> dict[str, Any]:
    nv = len(fm.variants)
    rows = []
    for p in fm.parameters:
        cells = []
        for s in fm.scenario_names:
            for i, v in enumerate(fm.variant_names):
                status, vd, kind, tip = _cell_attrs(fm, v, s, p.name)
                cells.append({"kind": kind, "first": i == 0, "s": s, "v": v, "status": status, "verdict": vd,
                              "tip": "\n".join(tip), "symbol": SYMBOL.get(kind, "")})  # fmt: skip
        rows.append({"name": p.name, "frozen": not p.requires_grad, "cells": cells})
    return {
        "nv": nv,
        "cw": max(30, 60 // nv),
        "scenarios": fm.scenario_names,
        # Vertical text without wrapping: the header row is as tall as the longest (shortened) name, so
        # a name can neither spill over the scenario titles above nor into the next column.
        "names": [{"full": v, "short": _short(v)} for v in fm.variant_names],
        "rows": rows,
        "legend": [(k, SYMBOL.get(k, ""), text) for k, text in LEGEND],
        "key": [(_short(v), v) for v in fm.variant_names if _short(v) != v],
    }


# ----- charts ----------------------------------------------------------------------------------


def _styles(names: Sequence[str]) -> dict[str, tuple[str, str, str]]:
    """(colour, dash pattern, marker) of each variant, by its place in ``names``."""
    return {
        v: (PALETTE[i % len(PALETTE)], DASHES[i % len(DASHES)], MARKERS[i % len(MARKERS)])
        for i, v in enumerate(names)
    }


def _marker(shape: str, x: float, y: float, r: float, colour: str, **extra: Any) -> dict[str, Any]:
    """One point marker of ``shape`` centred on (x, y)."""
    if shape == "circle":
        return _e("circle", cx=f"{x:.1f}", cy=f"{y:.1f}", r=f"{r:.1f}", fill=colour, **extra)
    if shape == "square":
        a = r * 0.9
        return _e("rect", x=f"{x - a:.1f}", y=f"{y - a:.1f}", width=f"{2 * a:.1f}", height=f"{2 * a:.1f}",
                  fill=colour, **extra)  # fmt: skip
    if shape == "plus":
        d = f"M{x - r:.1f} {y:.1f}H{x + r:.1f}M{x:.1f} {y - r:.1f}V{y + r:.1f}"
        return _e("path", d=d, stroke=colour, stroke_width=f"{max(r * 0.7, 1.5):.1f}", **extra)
    a = r * 1.15
    corners = {
        "triangle": ((x, y - a), (x - a, y + a * 0.75), (x + a, y + a * 0.75)),
        "down": ((x, y + a), (x - a, y - a * 0.75), (x + a, y - a * 0.75)),
        "diamond": ((x, y - a), (x + r, y), (x, y + a), (x - r, y)),
    }[shape]
    return _e("polygon", points=" ".join(f"{px:.1f},{py:.1f}" for px, py in corners), fill=colour, **extra)


def _cross(x: float, y: float, r: float, colour: str = FAIL, width: float = 2.0) -> dict[str, Any]:
    """An x drawn with lines (failed or missing), centred on (x, y)."""
    d = f"M{x - r:.1f} {y - r:.1f}L{x + r:.1f} {y + r:.1f}M{x - r:.1f} {y + r:.1f}L{x + r:.1f} {y - r:.1f}"
    return _e("path", d=d, stroke=colour, stroke_width=f"{width:g}", fill="none")


def _icon(width: int, *kids: dict[str, Any]) -> dict[str, Any]:
    return _e("svg", *kids, width=width, height=12, aria_hidden="true")


def _swatch(style: tuple[str, str, str], line: bool = True) -> dict[str, Any]:
    """A legend swatch: the variant's line (with its dash pattern) and marker, or a bar of its colour."""
    colour, dash, shape = style
    if not line:
        return _icon(14, _e("rect", x=2, y=0, width=10, height=12, fill=colour))
    return _icon(
        34,
        _e("line", x1=1, x2=33, y1=6, y2=6, stroke=colour, stroke_width=2, stroke_dasharray=dash or None),
        _marker(shape, 17, 6, 3.5, colour),
    )


def _failed_swatch() -> dict[str, Any]:
    return _icon(14, _cross(7, 6, 4.5))


def _failed_bar(x: float, y: float, w: float, h: float, **extra: Any) -> dict[str, Any]:
    """A run that failed, where its bar would be: a grey bar of the plot's full height, outlined in dashes
    (no pattern: a ``url(#...)`` fill would be the page's only ``url(``)."""
    return _e("rect", x=f"{x:.1f}", y=f"{y:.1f}", width=f"{w:g}", height=f"{h:g}", fill="#b8bec8",
              stroke="#374151", stroke_width=1, stroke_dasharray="2 2", **extra)  # fmt: skip


def _failed_bar_swatch() -> dict[str, Any]:
    return _icon(14, _failed_bar(3.5, 0.5, 7, 11))


def _entry(text: str, svg: dict[str, Any] | None = None, cls: str = "", title: str = "", inner: bool = False):
    """A legend entry: a swatch and its text (in a span of its own when ``inner``)."""
    return {"text": text, "svg": svg, "cls": cls, "title": title, "inner": inner}


def _log_range(values: list[float]) -> tuple[int, int]:
    logs = [math.log10(x) for x in values if x > 0 and math.isfinite(x)]
    lo, hi = (math.floor(min(logs)), math.ceil(max(logs))) if logs else (0, 1)
    return lo, max(hi, lo + 1)


def _y_axis(lo: int, hi: int, x0: int, x1: int, y: Any) -> list[dict[str, Any]]:
    """Horizontal grid lines and labels at powers of ten."""
    step = max(1, math.ceil((hi - lo) / 8))
    out = []
    for k in range(lo, hi + 1, step):
        out.append(_e("line", x1=x0, x2=x1, y1=f"{y(k):.1f}", y2=f"{y(k):.1f}", stroke="#e5e7eb"))
        out.append(_e("text", text=f"1e{k}", x=x0 - 4, y=f"{y(k) + 4:.1f}", text_anchor="end"))
    return out


def _why(err: Any) -> str:
    return f"{err.stage} {err.type}: {err.message}" if err else "no run recorded"


def _norm_chart(fm: FlowMap, scenario: str, lo: int, hi: int) -> dict[str, Any]:
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
    parts = _y_axis(lo, hi, left, w - 6, y)
    for i, p in enumerate(params):
        x0 = left + i * gw + 3
        for k, v in enumerate(names):
            x = x0 + k * slot
            mid = x + slot / 2
            if v in failed:
                tip = f"{p} · {v}: run failed — {failed[v]}"
                parts.append(
                    {
                        **_failed_bar(x + 0.5, top, slot - 2, ph, data_variant=v, data_kind="failed"),
                        "title": tip,
                    }
                )
                continue
            c = cells[v].get(p)
            status, norm, vd = (c.status, c.norm, c.verdict or "") if c else ("absent", None, "")
            said = f", {vd} vs {fm.reference}" if vd and vd != "match" else ""
            tip = f"{p} · {v}: {status}, L1 norm {_num(norm, '.4g')}{said}"
            if status == "nonzero" and norm and norm > 0:
                yt = min(y(math.log10(norm)), base - 1)
                outline = {"stroke": FAIL, "stroke_width": 1.5} if vd == "wrong" else {}
                parts.append(_e("rect", title=tip, x=f"{x:.1f}", y=f"{yt:.1f}", width=slot - 1,
                                height=f"{base - yt:.1f}", fill=styles[v][0], **outline, data_variant=v,
                                data_kind="bar"))  # fmt: skip
            elif status in ("nan", "inf"):
                parts.append(_e("text", title=tip, text=SYMBOL[status], x=f"{mid:.1f}", y=top + 10, class_="nf",
                                text_anchor="middle", data_variant=v, data_kind=status))  # fmt: skip
            elif vd == "missing" or status == "absent":
                r = 3.5
                parts.append(
                    _e(
                        "g",
                        _cross(mid - 0.5, base - r - 2, r, FAIL, 2),
                        title=tip,
                        data_variant=v,
                        data_kind="missing",
                    )
                )
        centre = left + i * gw + gw / 2
        short = p if len(p) <= 26 else "…" + p[-25:]
        parts.append(_e("text", title=p, text=short, transform=f"translate({centre + 4:.1f},{base + 8}) rotate(-55)",
                        text_anchor="end"))  # fmt: skip
    parts.append(_e("line", x1=left, x2=w - 6, y1=base, y2=base, stroke="#6b7280"))
    notes = [
        _entry(f"{v}: run failed — {why}", _failed_bar_swatch(), cls="failed", title=why)
        for v, why in failed.items()
    ]
    svg = _e("svg", *parts, width=w, height=base + bottom, role="img")
    return {"width": w, "caption": scenario, "svg": svg, "notes": notes}


def _norm_charts(fm: FlowMap) -> dict[str, Any] | None:
    singles = [s.name for s in fm.scenarios if len(s.terms) == 1]
    if not singles:
        return None
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
    key = [_entry(v, _swatch(styles[v], line=False)) for v in fm.variant_names]
    if len(fm.variants) > 1:
        key.append(_entry(f"gradient lost: {fm.reference} has one, this variant none", _failed_swatch()))
        box = _e("rect", x=2, y=1, width=10, height=10, fill="#fff", stroke=FAIL, stroke_width=1.5)
        key.append(_entry(f"wrong value vs {fm.reference}", _icon(14, box)))
    if any((r := _run(fm, v, s)) is None or r.error is not None for v in fm.variant_names for s in singles):
        key.append(_entry("run failed", _failed_bar_swatch()))
    key.append(_entry("N / ∞: NaN / infinite gradient; an empty slot: no gradient"))
    return {"key": key, "charts": charts}


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
) -> dict[str, Any]:
    """Each variant's loss curve on a log scale, in its colour, dash pattern and marker; gaps where a value
    is not positive. Curves that coincide on screen are drawn wider underneath and their markers side by
    side, so each stays visible; a variant that failed ends in a red x labelled "failed" (at the top left
    when it has no value at all), and its legend entry says why, in full (the legend wraps)."""
    values = [x for _, xs, _, _ in series for x in xs if x is not None]
    lo, hi, ticks = _curve_axis(values)
    n = max((len(xs) for _, xs, _, _ in series), default=1)
    left, top, pw, ph = 52, 10, 340, 160
    y = lambda k: top + ph * (1 - (k - lo) / (hi - lo))  # noqa: E731
    parts = []
    for t, label in ticks:
        parts.append(_e("line", x1=left, x2=left + pw, y1=f"{y(t):.1f}", y2=f"{y(t):.1f}", stroke="#e5e7eb"))
        parts.append(_e("text", text=label, x=left - 4, y=f"{y(t) + 4:.1f}", text_anchor="end"))
    parts.append(_e("text", text="step 0", x=left, y=top + ph + 15))
    parts.append(_e("text", text=str(n - 1), x=left + pw, y=top + ph + 15, text_anchor="end"))
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
        segs, seg = [], []
        for j in range(len(xs)):
            if j in points[i]:
                seg.append("{:.1f},{:.1f}".format(*points[i][j]))
            elif seg:
                segs, seg = [*segs, seg], []
        for pts in (p for p in [*segs, seg] if p):
            parts.append(_e("polyline", fill="none", stroke=colour, stroke_width=f"{width:g}",
                            stroke_dasharray=dash or None, points=" ".join(pts), data_variant=v))  # fmt: skip
        parts.extend(
            _marker(shape, px + dx, py, r, colour, stroke="#fff", stroke_width=0.8)
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
            label = _e("text", text=f"{_short(v, 30)} failed", x=f"{lx:.1f}", y=f"{max(ly, top + 9):.1f}",
                       class_="nf", text_anchor=anchor)  # fmt: skip
            fails.append(_e("g", _cross(px + dx, py, 5.5), label, data_variant=v, data_kind="failed"))
            why = error or "the check marked it as an error"
            legend.append(
                _entry(
                    f"{v}: failed after {len(points[i])} value(s) — {why}", swatch, cls="failed", inner=True
                )
            )
        else:
            text = f"{v}: {said}" if said else v
            legend.append(_entry(text + tail, swatch, inner=True))
    w = left + pw + 12
    svg = _e("svg", *parts, *fails, width=w, height=top + ph + 20, role="img")
    return {"width": max(w, 420), "caption": term, "svg": svg, "legend": legend}


def _curves(check: dict[str, Any], variants: Sequence[str] = ()) -> list[dict[str, Any]]:
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
    return [_curve_chart(t, series, styles.__getitem__) for t, series in by_term.items()]


def _balance(b: Any) -> dict[str, Any] | None:
    """The balance check as tables: each group's gradient norm shared out by term, the conflicting
    pairs, and one optimizer step per term against the joint one."""
    if not isinstance(b, dict) or b.get("error"):
        return None
    try:
        groups = [g for g in b["groups"] if any(b["norms"][t][g] > 0 for t in b["norms"])]
        drowned = {(d["term"], d["group"]): d for d in b.get("dominated") or ()}
        rows = []
        for term, shares in b["shares"].items():
            cells = [_c(term, code=True)]
            for g in groups:
                norm = b["norms"][term][g]
                if norm <= 0:
                    cells.append(_c("-", "num share"))
                    continue
                d, pct = drowned.get((term, g)), 100 * shares[g]
                note = f"; drowned by {d['by']}" if d else ""
                bar = f"background:linear-gradient(#60a5fa,#60a5fa) no-repeat left bottom/{pct:.1f}% 4px"
                title = f"{term} in {g}: L1 norm {norm:.4g}, {pct:.1f}% of the group{note}"
                cells.append(_c(f"{pct:.1f}%", "num share bad" if d else "num share", style=bar, title=title))
            rows.append(cells)
        tables = [
            ("Share of each group's gradient norm, by term (at the step's prefactors)",
             _table(["term", *(_c(g, code=True) for g in groups)], rows)),
        ]  # fmt: skip
        conflicts = b.get("conflicts") or []
        if conflicts:
            cgroups = sorted({g for c in conflicts for g in c.get("groups", {})}, key=groups.index)
            crow = [
                [" vs ".join(map(str, c["terms"])), _c(f"{c['cosine']:.2f}", "num bad" if c["cosine"] < 0 else "num"),
                 *(_c(f"{c['groups'][g]:.2f}", "num") if g in c.get("groups", {}) else "-" for g in cgroups)]
                for c in conflicts
            ]  # fmt: skip
            tables.append(
                ("Cosine between the terms' gradients (negative: they pull apart)",
                 _table(["terms", "all", *(_c(g, code=True) for g in cgroups)], crow))
            )  # fmt: skip
        update = b.get("effective_update") or {}
        if update.get("terms"):
            urows = [
                [_c(t, code=True), _c(f"{u['cosine_with_joint']:.2f}", "num"),
                 _c(_num(u.get("norm_alone")), "num"), _c(_num(u.get("norm_joint")), "num")]
                for t, u in update["terms"].items()
            ]  # fmt: skip
            tables.append(
                (f"One {update.get('optimizer', '')} step: each term alone vs all together",
                 _table(["term", "cosine with the joint step", "|step| alone", "|step| joint"], urows))
            )  # fmt: skip
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError):
        return None  # a balance dict of another shape: its lines stay in the list above
    errors = [(str(part), str(error)) for part, error in (b.get("errors") or {}).items()]
    return {"tables": tables, "errors": errors}


def _checks(fm: FlowMap) -> dict[str, Any] | None:
    """Verification checks: the terminal's check lines, the balance tables and the training curves."""
    balance = _balance(fm.checks.get("balance"))
    rest = {k: x for k, x in fm.checks.items() if k != "balance"} if balance else fm.checks
    try:
        lines = check_lines(msgspec.structs.replace(fm, checks=rest) if balance else fm)
    except (KeyError, TypeError, AttributeError, ValueError):  # a checks dict of another shape: curves only
        lines = []
    training = fm.checks.get("training")
    curves = _curves(training, fm.variant_names) if isinstance(training, dict) else []
    if not (lines or balance or curves):
        return None
    return {"lines": [(x.startswith(" "), x.strip()) for x in lines], "balance": balance, "curves": curves}


# ----- environment and page --------------------------------------------------------------------


def _environment(fm: FlowMap) -> dict[str, Any]:
    facts = [
        ("gradprobe", fm.gradprobe_version), ("torch", fm.torch_version), ("device", fm.device),
        ("dtype", fm.dtype), ("step contract", fm.mode), ("terms", ", ".join(fm.terms)),
        ("reference", fm.reference), ("rtol", _num(fm.rtol, "g")),
    ]  # fmt: skip
    rows = [
        [_c(v.name, code=True, wbr=True), ", ".join(f"{k}={x}" for k, x in v.knobs.items()) or "-",
         v.capture, v.backend or "-", _num(v.compile_count, "g"), _num(v.graphs, "g"),
         _num(v.graph_breaks, "g"), f"{v.seconds:.1f}s",
         f"{v.error.stage} {v.error.type}: {v.error.message}" if v.error else "-"]
        for v in fm.variants
    ]  # fmt: skip
    header = ["variant", "knobs", "capture", "backend", "compiled", "graphs", "breaks", "time", "build error"]
    return {
        "facts": _table([], [[_c(k, b=True), x] for k, x in facts]),
        "variants": _table(header, rows),
        "lines": variant_lines(fm) + meaning_lines(fm) + [f"warning: {w}" for w in fm.warnings],
    }


def render_html(fm: FlowMap) -> str:
    """The whole report as one self-contained HTML page. The first screen: the verdict, one line per
    finding and the heat map; the details below."""
    page = _template().render(
        header=_header(fm),
        overview=_overview(fm),
        heatmap=_heatmap(fm),
        findings=_findings(fm),
        summary=_summary(fm),
        events=_events(fm),
        norms=_norm_charts(fm),
        checks=_checks(fm),
        trials=_trials(fm),
        diffs=_diffs(fm),
        environment=_environment(fm),
    )
    return visible(page)
