"""The terminal report on a terminal: rich's colours and tables that fit the width; plain when piped.

The renderables are those of ``terminal.print_report`` (one render path, two looks): the verdict line
coloured by severity, the findings with their fix, the summary table with the failing cells and the
columns that hold them in red, the details with PASS/FAIL and severities coloured. Written to a pipe, a
file or under ``NO_COLOR``/``TERM=dumb`` (rich's own rules), the output is ``render(fm)`` (at the
terminal's width when it is one), the same text without colour.
"""

from __future__ import annotations

from typing import TextIO

from ..flowmap import FlowMap
from .terminal import print_report, render


def write_report(fm: FlowMap, stream: TextIO, *, show_all: bool = False) -> None:
    """The terminal report on ``stream``: styled on a terminal, ``render(fm)`` otherwise."""
    from rich.console import Console

    console = Console(file=stream, highlight=False, markup=False, emoji=False)
    if not console.is_terminal or console.color_system is None or console.no_color:
        width = console.width if console.is_terminal else None
        stream.write(render(fm, show_all=show_all, width=width))
        return
    print_report(console, fm, show_all=show_all, wrap=True)
