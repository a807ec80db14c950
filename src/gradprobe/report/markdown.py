"""Markdown (GitHub-flavoured) rendering for a pull-request comment: verdict, findings with the fix,
the summary table, what the differences mean, and the per-parameter diff of what differs.

Every user-derived string (parameter, term, scenario and variant names, messages, paths) goes through
``md_escape``; code lines go into code spans, which Markdown renders as literal text.
"""

from __future__ import annotations

import math
import os
import re

from ..flowmap import Finding, FlowMap
from .controls import visible
from .terminal import (
    cell_text,
    check_lines,
    interpretation_lines,
    meaning_lines,
    trial_rows,
    variant_lines,
    verdict,
)

DIFFERS = "⚠"
_SEVERITY = {"error": "🛑 ERROR", "warning": "⚠️ WARNING", "info": "ℹ️ INFO"}
_PUNCT = re.compile(r"([\\`*\[\]|#~])")
_EDGE_UNDERSCORE = re.compile(r"(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])")


def md_escape(text: object) -> str:
    """Text that Markdown shows literally, also inside a table cell: HTML-significant characters as
    entities, Markdown punctuation backslash-escaped, newlines as spaces."""
    s = str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    s = _PUNCT.sub(r"\\\1", s)
    s = _EDGE_UNDERSCORE.sub(r"\\_", s)  # a_b stays readable; _x_ / __init__ could start emphasis
    return " ".join(s.splitlines())


def md_code(text: object) -> str:
    """A code span holding ``text`` literally (fenced by more backticks than it contains)."""
    s = " ".join(str(text).splitlines())
    longest = max((len(m) for m in re.findall(r"`+", s)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return str(x) if math.isnan(x) or math.isinf(x) else f"{x:.3g}"


def _location(loc: dict | None) -> list[str]:
    """'`potential.py:73` in descriptor (Descriptor)' and the code line, when the location has them."""
    if not loc:
        return []
    if "file" not in loc:
        modules = loc.get("modules")
        return [f"- **where:** {md_escape(', '.join(map(str, modules)))}"] if modules else []
    where = f"{os.path.basename(str(loc['file']))}:{loc.get('line', '?')}"
    module = f" in {md_escape(loc['module'] or 'the root module')}" if loc.get("module") is not None else ""
    mtype = f" ({md_escape(loc['module_type'])})" if loc.get("module_type") else ""
    lines = [f"- **where:** {md_code(where)}{module}{mtype}"]
    if loc.get("code"):
        lines.append(f"- **code:** {md_code(loc['code'])}")
    return lines


def finding_markdown(f: Finding) -> list[str]:
    """One finding: severity and cause, the message, where, the fix, references."""
    out = [f"**{_SEVERITY.get(f.severity, f.severity)}** {md_code(f.cause)}: {md_escape(f.message)}", ""]
    out.extend(_location(f.location))
    if f.fix:
        out.append(f"- **fix:** {md_escape(f.fix)}")
    if f.references:
        out.append("- **see:** " + ", ".join(md_escape(r) for r in f.references))
    return [*out, ""]


def table(header: list[str], rows: list[list[str]], align: list[str] | None = None) -> list[str]:
    """A GFM table; cells must already be escaped."""
    align = align or ["---"] * len(header)
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def summary_markdown(fm: FlowMap) -> list[str]:
    """Scenario rows, variant columns, ``reached/trainable`` (``⚠`` where it differs from the reference)."""
    rows = []
    for s in fm.scenario_names:
        cells = []
        for v in fm.variant_names:
            text, _ = cell_text(fm, v, s)
            cells.append(md_escape(text.removesuffix(" !")) + (f" {DIFFERS}" if text.endswith(" !") else ""))
        rows.append([md_escape(s), *cells])
    header = ["scenario", *(md_escape(v) for v in fm.variant_names)]
    return table(header, rows, ["---"] + ["---:"] * len(fm.variant_names))


def diff_markdown(fm: FlowMap, variant: str, scenario: str) -> list[str]:
    """The parameters of one run whose verdict against the reference is not ``match``."""
    diffs = fm.differences(variant, scenario)
    if not diffs:
        return []
    ref_cells = fm.cells_of(fm.reference, scenario)
    rows = [
        [
            md_escape(p),
            ref_cells[p].status if p in ref_cells else "-",
            c.status,
            _num(c.rel_error),
            f"**{c.verdict}**",
        ]
        for p, c in diffs.items()
    ]
    header = ["parameter", md_escape(fm.reference), md_escape(variant), "rel. error", "verdict"]
    title = f"**{md_escape(scenario)}**: {md_escape(fm.reference)} vs {md_escape(variant)}"
    return [title, "", *table(header, rows, ["---", "---", "---", "---:", "---"]), ""]


def _checks(fm: FlowMap) -> list[str]:
    """The terminal's line per verification check; none for a checks dict of another shape."""
    try:
        return check_lines(fm)
    except (KeyError, TypeError, AttributeError, ValueError):
        return []


def render_markdown(fm: FlowMap) -> str:
    """The whole report as GitHub-flavoured Markdown, for a pull-request comment."""
    out = [f"## gradprobe: {md_escape(verdict(fm))}", ""]
    serious = [f for f in fm.findings if f.severity != "info"]
    info = [f for f in fm.findings if f.severity == "info"]
    for f in serious:
        out.extend(finding_markdown(f))
    rtol = f", rtol {fm.rtol:g}" if fm.rtol is not None else ""
    note = f"; {DIFFERS} = differs from {md_escape(fm.reference)} in reach or value{rtol}"
    out += [
        "### Parameters reached per scenario",
        "",
        f"Non-zero gradient / trainable, {md_escape(fm.device)} {md_escape(fm.dtype)}"
        + (note if len(fm.variants) > 1 else "")
        + ".",
        "",
        *summary_markdown(fm),
        "",
    ]
    interp = interpretation_lines(fm)
    if interp:
        out += ["### What differs", "", *(f"- {md_escape(line)}" for line in interp), ""]
    diffs = [
        line
        for v in fm.variant_names
        if v != fm.reference
        for s in fm.scenario_names
        for line in diff_markdown(fm, v, s)
    ]
    if diffs:
        out += ["<details><summary>Per-parameter diff (differing parameters only)</summary>", "", *diffs]
        out += ["</details>", ""]
    for variant, scenarios, rows in trial_rows(fm):
        out += [
            f"#### Bisection of {md_escape(variant)}"
            + (f" (on {md_escape(scenarios)})" if scenarios else ""),
            "",
            *table(
                ["flip", "result", "seconds"],
                [[md_escape(flip), md_escape(result), sec] for flip, result, sec in rows],
                ["---", "---", "---:"],
            ),
            "",
        ]
    details = [f"- {md_escape(line)}" for line in meaning_lines(fm) + variant_lines(fm) + _checks(fm)]
    details += [f"- **warning:** {md_escape(w)}" for w in fm.warnings]
    if details:
        out += ["<details><summary>Details</summary>", "", *details, "", "</details>", ""]
    for f in info:
        out.extend(finding_markdown(f))
    out.append(f"<sub>gradprobe {md_escape(fm.gradprobe_version)}, torch {md_escape(fm.torch_version)}</sub>")
    return visible("\n".join(out) + "\n")
