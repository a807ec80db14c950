"""The terminal report on a terminal: rich's colours and a table that fits the width; plain when piped.

The words are those of ``terminal.render`` (one text, two looks): the verdict line coloured by severity,
the findings with their fix, the summary table with the failing cells and the columns that hold them in
red, the details with PASS/FAIL and severities coloured. Written to a pipe, a file or under
``NO_COLOR``/``TERM=dumb`` (rich's own rules), the output is ``render(fm)`` byte for byte.
"""

from __future__ import annotations

import re
from typing import TextIO

from ..flowmap import Finding, FlowMap
from .controls import visible
from .terminal import (
    details_lines,
    finding_lines,
    render,
    table_cells,
    table_footer,
    table_title,
    verdict,
)

SEVERITY_STYLE = {"error": "bold red", "warning": "bold yellow", "info": "cyan"}
# Words in the details that a reader's eye should find: verdicts of checks and severities.
HIGHLIGHTS = (
    (r"\bFAIL\b", "bold red"),
    (r"\bPASS\b", "bold green"),
    (r"^\s*ERROR\b", "bold red"),
    (r"^\s*WARNING\b", "bold yellow"),
    (r"^\s*INFO\b", "cyan"),
    (r"^\s*fix:", "bold cyan"),
)


def write_report(fm: FlowMap, stream: TextIO, *, show_all: bool = False) -> None:
    """The terminal report on ``stream``: styled on a terminal, ``render(fm)`` otherwise."""
    from rich.console import Console

    console = Console(file=stream, highlight=False)
    if not console.is_terminal or console.color_system is None or console.no_color:
        stream.write(render(fm, show_all=show_all))
        return
    _print_styled(fm, console, show_all)


def _print_styled(fm: FlowMap, console: object, show_all: bool) -> None:
    from rich.console import Console
    from rich.text import Text

    assert isinstance(console, Console)
    head = verdict(fm)
    style = (
        "bold red"
        if head.startswith("PROBLEM")
        else "bold yellow"
        if head.startswith("check")
        else "bold green"
    )
    console.print(Text.assemble(("gradprobe: ", "bold"), (head, style)))
    console.print()
    serious = [f for f in fm.findings if f.severity != "info"]
    for f in serious:
        console.print(_finding(f))
    if serious:
        console.print()
    console.print(Text(visible(table_title(fm)), style="dim"))
    console.print(_table(fm))
    footer = table_footer(fm)
    if footer:
        console.print(Text(footer, style="red"))
    details = Text(visible("\n".join(details_lines(fm, show_all=show_all))))
    for pattern, pattern_style in HIGHLIGHTS:
        details.highlight_regex(re.compile(pattern, re.MULTILINE), pattern_style)
    console.print(details)


def _finding(f: Finding) -> object:
    from rich.text import Text

    first, *rest = finding_lines(f)
    text = Text()
    text.append(f.severity.upper(), SEVERITY_STYLE.get(f.severity, ""))
    text.append(" ")
    text.append(f.cause, "bold")
    text.append(visible(first[len(f.severity) + 1 + len(f.cause) :]))
    for line in rest:
        text.append("\n")
        if line.startswith("  fix: "):
            text.append("  fix: ", "bold cyan")
            text.append(visible(line[len("  fix: ") :]))
        else:
            text.append(visible(line))
    return text


def _table(fm: FlowMap) -> object:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    variants = list(fm.variant_names)
    columns = table_cells(fm, variants)
    several = len(variants) > 1
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    table.add_column("scenario", style="bold", no_wrap=True)
    for v, col in zip(variants, columns, strict=True):
        failing = any(bad for _, bad in col)
        # A long pipeline name breaks at its stages (make_fx[...] / +compile:...), not mid-word.
        name = visible(v).replace("+", "\n+") if len(v) > 24 else visible(v)
        header = Text(name, style="bold red" if failing else "bold")
        if several and v == fm.reference:
            header.append(" (reference)", "dim")
        # What is still too long folds rather than push the table past the width.
        table.add_column(header, overflow="fold")
    for i, s in enumerate(fm.scenario_names):
        cells = []
        for col in columns:
            text, bad = col[i]
            cells.append(Text(visible(text), style="bold red" if bad else "green" if several else ""))
        table.add_row(Text(visible(s)), *cells)
    return table
