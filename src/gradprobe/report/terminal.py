"""The terminal report: verdict and findings with the fix, the comparison table with its
interpretation, what the counts mean, and the per-parameter diff of what differs.

One render path: the report is a sequence of rich renderables (lines of ``Text``, tables as rich
``Table``s) printed through one ``Console``. ``render`` exports the plain text from a console without
colour; ``styled.write_report`` prints the same renderables in colour on a terminal. Tables fit the width
(the terminal's, else ``COLUMNS``, else ``DEFAULT_WIDTH``): a column header wraps only where a
variant's name has a boundary (after ``:`` or ``,``, before ``[`` or ``+``), never inside a word, and a
table too wide for that is split into several tables of fewer columns, each with its row labels.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from io import StringIO
from typing import TYPE_CHECKING, Any, TypeAlias

from ..declarations import note_for
from ..flowmap import Finding, FlowMap, RunError
from ..wording import names
from .controls import visible

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

# The width of the tables in plain text when none is asked for (a file, a pipe, pytest, ``render(fm)``).
DEFAULT_WIDTH = 100
GAP = 2  # spaces between two columns
# The reach table where all of it fits: labels in 20 columns and 3 spaces between two columns (the
# layout of the plain report before it was fitted to the width).
SUMMARY_ROOMY = (20, 3)
# Where a column header may wrap: after ':' or ',', before '[' or '+' (a variant's stages and knobs).
_BREAKS = re.compile(r"(?<=[:,])(?=.)|(?=[\[+])")
SEVERITY_STYLE = {"error": "bold red", "warning": "bold yellow", "info": "cyan"}


def error_text(error: RunError) -> str:
    """A short cell text for a failed run."""
    if error.type == "NoGradPath":
        return "no grad path"
    if error.type == "DynamoFallback":
        return "error: ran eager (dynamo fallback)"
    if "double backward" in error.message:
        return "error: double backward unsupported"
    if "donated buffers" in error.message:
        return "error: donated buffers"
    if "coerce_to_expected_memory_format" in " ".join(error.frames):
        return "error: tangent strides"
    if error.type == "InternalTorchDynamoError":
        return "error: dynamo internal"
    return f"error: {error.type}"


def cell_text(fm: FlowMap, variant: str, scenario: str) -> tuple[str, bool]:
    """(text, differs from the reference)."""
    run = fm.run(variant, scenario)
    if run.error is not None:
        return error_text(run.error), True
    reached, total = fm.count(variant, scenario)
    differs = bool(fm.differences(variant, scenario))
    return f"{reached}/{total}" + (" !" if differs else ""), differs


def table_cells(fm: FlowMap, variants: Sequence[str]) -> list[list[tuple[str, bool]]]:
    """Per variant (column), per scenario (row): (cell text, the cell is a problem: the run failed, or
    it differs from the reference)."""
    return [[cell_text(fm, v, s) for s in fm.scenario_names] for v in variants]


def report_width(width: int | None = None) -> int:
    """The tables' width: ``width``, else ``COLUMNS`` when it is set, else ``DEFAULT_WIDTH``."""
    columns = os.environ.get("COLUMNS", "").strip()
    if width is None and columns.isdigit() and int(columns) > 0:
        width = int(columns)
    return max(width or DEFAULT_WIDTH, 20)


def header_pieces(name: str) -> list[str]:
    """A column header cut where it may wrap: ``make_fx[detach=alias]+compile:aot_eager`` is
    ``make_fx``, ``[detach=alias]``, ``+compile:``, ``aot_eager``."""
    return [p for p in _BREAKS.split(name) if p]


def wrap_header(name: str, width: int) -> list[str]:
    """``name`` in lines of at most ``width`` columns, cut only between its pieces (a piece longer than
    the width stays whole on its own line)."""
    from rich.cells import cell_len

    lines: list[str] = []
    for piece in header_pieces(name):
        if lines and cell_len(lines[-1]) + cell_len(piece) <= width:
            lines[-1] += piece
        else:
            lines.append(piece)
    return lines


@dataclass
class Column:
    """One column of a terminal table: its header, its cells (one per row) and their styles; a column
    that may not ``wrap`` (the row labels) keeps its cells whole unless nothing else fits; ``least``:
    the width it takes when there is room, however narrow its cells."""

    header: str
    cells: list[str]
    header_style: str = ""
    styles: list[str] = field(default_factory=list)
    justify: str = "left"
    wrap: bool = True
    least: int = 1

    def span(self) -> tuple[int, int, int]:
        """(narrowest width that cuts no word of a cell and no piece of the header, narrowest that
        keeps every cell whole, natural width)."""
        from rich.cells import cell_len

        words = [cell_len(w) for c in self.cells for w in c.split()]
        pieces = [cell_len(p) for p in header_pieces(self.header)]
        cells = [cell_len(c) for c in self.cells]
        natural = max([self.least, cell_len(self.header), *cells])
        whole = max([1, *pieces, *cells])
        return (max([1, *words, *pieces]) if self.wrap else whole), whole, natural


def fit_widths(columns: Sequence[Column], width: int) -> list[int] | None:
    """Content widths for ``columns`` side by side in ``width`` columns (``GAP`` between two), each at
    least its narrowest; None when even the narrowest do not fit. The room beyond goes first to the
    columns whose cells it keeps whole (the cheapest first), then to headers on fewer lines."""
    spans = [c.span() for c in columns]
    room = width - GAP * (len(columns) - 1)
    widths = [lo for lo, _, _ in spans]
    if sum(widths) > room:
        return None
    for stage in (1, 2):
        slack = room - sum(widths)
        wanting = sorted(
            (spans[i][stage] - widths[i], i) for i in range(len(spans)) if widths[i] < spans[i][stage]
        )
        for need, i in wanting:
            if need <= slack:
                widths[i] += need
                slack -= need
        # What is left narrows the wrapping of the columns still short of their target.
        short = [i for _, i in wanting if widths[i] < spans[i][stage]]
        while slack > 0 and short:
            for i in list(short):
                if slack and widths[i] < spans[i][stage]:
                    widths[i] += 1
                    slack -= 1
                else:
                    short.remove(i)
    return widths


def _forced_widths(columns: Sequence[Column], width: int) -> list[int]:
    """Widths for columns that cannot fit whole (a single word wider than the width): the widest
    narrowed until they fit, the rest of what does not fit folded by rich."""
    widths = [c.span()[0] for c in columns]
    room = max(width - GAP * (len(columns) - 1), len(columns))
    while sum(widths) > room:
        i = widths.index(max(widths))
        widths[i] -= min(widths[i] - 1, sum(widths) - room) or 1
    return widths


def tables(
    label: Column, columns: Sequence[Column], width: int, *, roomy: tuple[int, int] | None = None
) -> list[Table]:
    """The row labels and ``columns`` as rich tables of at most ``width`` columns: one table when it
    fits, else consecutive groups of columns, each beside the labels. With ``roomy`` = (the labels'
    least width, the gap), the table is laid out so when all of it fits on one line per row."""
    if roomy is not None:
        least, gap = roomy
        every = [label, *columns]
        widths = [max(least, label.span()[2]), *(c.span()[2] for c in columns)]
        if sum(widths) + gap * len(columns) <= width:
            return [_table(every, widths, gap=gap)]
    groups: list[list[Column]] = []
    for column in columns:
        if groups and fit_widths([label, *groups[-1], column], width) is not None:
            groups[-1].append(column)
        else:
            groups.append([column])
    out = []
    for group in groups or [[]]:
        every = [label, *group]
        out.append(_table(every, fit_widths(every, width) or _forced_widths(every, width)))
    return out


def _table(columns: Sequence[Column], widths: Sequence[int], *, gap: int = GAP) -> Table:
    from rich.table import Table
    from rich.text import Text

    headers = [wrap_header(c.header, w) for c, w in zip(columns, widths, strict=True)]
    height = max(len(h) for h in headers)
    table = Table(
        box=None,
        show_header=height > 0,
        show_edge=False,
        pad_edge=False,
        padding=(0, gap, 0, 0),
        header_style="",
    )
    for c, w, lines in zip(columns, widths, headers, strict=True):
        # Headers of fewer lines sit on the last line, beside the others' last piece.
        header = Text("\n".join([""] * (height - len(lines)) + lines), style=c.header_style)
        table.add_column(header, width=w, justify=c.justify, overflow="fold")  # type: ignore[arg-type]
    for i in range(max((len(c.cells) for c in columns), default=0)):
        table.add_row(
            *(
                Text(c.cells[i] if i < len(c.cells) else "", style=c.styles[i] if i < len(c.styles) else "")
                for c in columns
            )
        )
    return table


def summary_columns(fm: FlowMap, variants: Sequence[str] | None = None) -> tuple[Column, list[Column]]:
    """The reach table: the scenarios' labels, and one column per variant (its failing cells and the
    header of a column that holds one in red, the healthy cells green when there is a comparison)."""
    variants = list(variants or fm.variant_names)
    several = len(variants) > 1
    labels = [visible(f"{s}:") for s in fm.scenario_names]
    # The scenarios' labels stay on one line unless they would take more than a third of the width.
    label = Column("", labels, styles=["bold"] * len(labels), wrap=max(map(len, labels), default=0) > 32)
    columns = []
    for v, col in zip(variants, table_cells(fm, variants), strict=True):
        failing = any(bad for _, bad in col)
        columns.append(
            Column(
                visible(v),
                [visible(text) for text, _ in col],
                header_style="bold red" if failing else "bold",
                styles=["bold red" if bad else "green" if several else "" for _, bad in col],
            )
        )
    return label, columns


def summary_table(fm: FlowMap, variants: Sequence[str] | None = None, *, width: int | None = None) -> str:
    """One row per scenario, one column per variant: reached/trainable (``!`` where the cell differs
    from the reference in reach or value), or the run's error: the failing cells say so themselves.
    Plain text of at most ``width`` (default ``report_width()``) columns."""
    width = report_width(width)
    console = plain_console(width)
    for i, table in enumerate(tables(*summary_columns(fm, variants), width, roomy=SUMMARY_ROOMY)):
        if i:
            console.print()
        print_table(console, table)
    return console.file.getvalue().rstrip("\n")  # type: ignore[attr-defined]


def plain_console(width: int) -> Console:
    """A console that writes plain text (no colour, no control sequence) of ``width`` columns to a
    string (``console.file.getvalue()``), whatever the environment says of the terminal."""
    from rich.console import Console

    return Console(
        file=StringIO(),
        width=width,
        color_system=None,
        force_terminal=False,
        force_jupyter=False,
        force_interactive=False,
        no_color=True,
        highlight=False,
        markup=False,
        emoji=False,
        legacy_windows=False,
        tab_size=8,
    )


def print_table(console: Console, table: Table, *, indent: int = 0) -> None:
    """``table`` on ``console`` after ``indent`` spaces, each line without the spaces that pad it on
    the right."""
    from rich.text import Text

    options = console.options.update_width(max(console.width - indent, 1))
    for line in console.render_lines(table, options, pad=False):
        text = Text.assemble(" " * indent, *((seg.text, seg.style) for seg in line if not seg.control))
        text.rstrip()
        console.print(text, soft_wrap=True)


@dataclass
class Indented:
    """A table of the details: its row labels and columns, fitted to the width less ``indent``."""

    label: Column
    columns: list[Column]
    indent: int = 2


# A block of the details: a line of prose (plain or styled), or a table.
Block: TypeAlias = "str | Text | Indented"


def plain_lines(blocks: Sequence[Block], width: int) -> list[str]:
    """``blocks`` as plain lines: prose whole, tables fitted to ``width``."""
    console = plain_console(width)
    for block in blocks:
        if isinstance(block, Indented):
            for table in tables(block.label, block.columns, width - block.indent):
                print_table(console, table, indent=block.indent)
        else:
            console.print(visible(block) if isinstance(block, str) else block, soft_wrap=True)
    return console.file.getvalue().splitlines()  # type: ignore[attr-defined,no-any-return]


def table_footer(fm: FlowMap) -> str:
    """How many cells of the table are problems, and of which kind ('' when none)."""
    variants = list(fm.variant_names)
    failed = differ = 0
    for v, col in zip(variants, table_cells(fm, variants), strict=True):
        for s, (_, bad) in zip(fm.scenario_names, col, strict=True):
            if bad:
                failed += fm.run(v, s).error is not None
                differ += fm.run(v, s).error is None
    if not failed and not differ:
        return ""
    runs = len(variants) * len(fm.scenario_names)
    parts = [f"{differ} differ from {fm.reference} (!)"] if differ else []
    parts += [f"{failed} failed (error)"] if failed else []
    return f"problem cells: {' and '.join(parts)}, of {runs} runs"


def table_title(fm: FlowMap) -> str:
    """What the counts are, what '!' means and at which tolerance (the one tolerance story)."""
    title = "parameters reached per scenario (non-zero gradient / trainable)"
    if len(fm.variants) > 1:
        rtol = (
            f" by more than {fm.rtol:g} (relative L1 error of a parameter's gradient)"
            if fm.rtol is not None
            else ""
        )
        title += f"; '!' = differs from {fm.reference} in reach, or in value{rtol}"
    return f"{title}, {fm.device} {fm.dtype}:"


def interpretation_lines(fm: FlowMap) -> list[str]:
    """What each differing (scenario, variant) pair means, against the reference."""
    lines = []
    ref = fm.reference
    for s in fm.scenario_names:
        ref_run = fm.run(ref, s)
        for v in fm.variant_names:
            if v == ref:
                continue
            run = fm.run(v, s)
            if run.error is not None:
                if ref_run.error is None:
                    lines.append(f"{s}, {v}: fails at {run.error.stage}: {run.error.message}")
                continue
            if ref_run.error is not None:
                continue
            summary = fm.mismatch(v, s)
            if summary is None:
                continue
            lines.append(f"{s}, {v}: {_meaning(fm, v, s, summary)}")
    return lines


def _meaning(fm: FlowMap, v: str, s: str, summary: dict) -> str:
    count, ref_count = summary["count"], summary["reference_count"]
    err = summary["max_rel_error"]
    wrong = summary["wrong"]
    # No finite error to quote when the wrong values are non-finite (NaN/inf on one side).
    bound = f" (rel. error up to {err:.2g})" if err is not None else " (non-finite)"
    wrong_text = f"{len(wrong)} of {count} reached have wrong values{bound}" if wrong else ""
    # What was measured, nothing more: the cause, where one is known, is the findings' to say.
    if count == 0 and ref_count > 0:
        head = f"reaches 0 vs {ref_count} in {fm.reference}: this path gives the term no gradient at all"
    elif count < ref_count:
        head = f"reaches {count} vs {ref_count} in {fm.reference}"
    elif count > ref_count:
        head = (
            f"reaches {count} vs {ref_count} in {fm.reference} — extra gradients the reference does not have"
        )
    else:
        head = f"{count} reached, like {fm.reference}, but values differ"
    parts = [head]
    if summary["missing"]:
        parts.append(f"lost: {names(summary['missing'])}")
    if summary["extra"]:
        parts.append(f"extra: {names(summary['extra'])}")
    if wrong_text:
        parts.append(wrong_text)
    covered = _covered_by_others(fm, v, s)
    if covered:
        parts.append(covered)
    return "; ".join(parts)


def _covered_by_others(fm: FlowMap, v: str, s: str) -> str:
    """'all' fine but this isolated scenario not: other terms cover the parameters."""
    for other in fm.scenarios:
        if other.name != s and len(other.terms) > 1 and s in {f"{t} only" for t in other.terms}:
            run = fm.run(v, other.name)
            if run.error is None and not fm.differences(v, other.name):
                return f"'{other.name}' matches: other terms cover these parameters (may be acceptable)"
    return ""


def diff_lines(
    fm: FlowMap,
    variant: str,
    scenario: str,
    *,
    show_all: bool = False,
    limit: int = 30,
    width: int | None = None,
) -> list[str]:
    """Per-parameter diff of one run against the reference: name, statuses, relative error, ``<-- DIFF``;
    plain text of at most ``width`` (default ``report_width()``) columns."""
    return plain_lines(
        diff_blocks(fm, variant, scenario, show_all=show_all, limit=limit), report_width(width)
    )


def diff_blocks(
    fm: FlowMap, variant: str, scenario: str, *, show_all: bool = False, limit: int = 30
) -> list[Block]:
    """``diff_lines`` as blocks: its title, the table (parameter, the reference's status, the variant's,
    relative error, ``<-- DIFF`` and the verdict) and what was left out."""
    ref = fm.reference
    cells = fm.cells_of(variant, scenario)
    ref_cells = fm.cells_of(ref, scenario)
    trainable = fm.trainable_set
    rows = [
        (p, ref_cells[p].status if p in ref_cells else "-", c.status, c.rel_error, c.verdict)
        for p, c in cells.items()
        if p in trainable and (show_all or c.verdict not in (None, "match"))
    ]
    if not rows:
        return []
    shown = rows[:limit]
    marks = [f"<-- DIFF {ver}" if ver not in (None, "match") else "" for *_, ver in shown]
    label = Column("parameter", [visible(r[0]) for r in shown], header_style="bold", wrap=False)
    columns = [  # where there is room: statuses in 8 columns, the mark 12 after the error's start
        Column(visible(ref), [visible(r[1]) for r in shown], header_style="bold", least=8),
        Column(visible(variant), [visible(r[2]) for r in shown], header_style="bold", least=8),
        Column("rel.err", [_num(r[3]) for r in shown], header_style="bold", least=10),
        Column("", [visible(m) for m in marks], styles=["bold red"] * len(marks)),
    ]
    out: list[Block] = [visible(f"{scenario}: {ref} vs {variant}"), Indented(label, columns)]
    hidden = len(rows) - limit
    if hidden > 0:
        out.append(f"  … and {hidden} more")
    same = len(cells) - len(rows)
    if same and not show_all:
        out.append(f"  ({same} identical parameters omitted, use --all to show)")
    return out


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return f"{x:.3g}"


def meaning_lines(fm: FlowMap, variant: str | None = None) -> list[str]:
    """Per scenario, which parameters the reference variant does not reach, and why when a note says so."""
    variant = variant or fm.reference
    lines = []
    for s in fm.scenario_names:
        run = fm.run(variant, s)
        if run.error is not None:
            lines.append(f"{s}: failed at {run.error.stage}: {run.error.message}")
            continue
        reached = fm.reached(variant, s)
        missing = [p for p in fm.trainable if p not in reached]
        if not missing:
            lines.append(f"{s}: every trainable parameter gets a non-zero gradient")
            continue
        by_note: dict[str, list[str]] = {}
        for p in missing:
            by_note.setdefault(note_for(p, fm.notes) or "", []).append(p)
        parts = [f"{names(ps)} ({note})" if note else names(ps) for note, ps in by_note.items()]
        lines.append(f"{s}: {len(missing)} not reached: " + "; ".join(parts))
    return lines


def variant_lines(fm: FlowMap) -> list[str]:
    """Build facts per compiled or traced variant: compile count, graphs, breaks, time, second batch."""
    lines = []
    for v in fm.variants:
        if v.capture == "eager" and v.backend is None and not v.second_batch:
            continue
        facts = [f"{v.seconds:.1f}s"]
        if v.compile_count is not None:
            facts.append(f"compiled {v.compile_count}x")
        if v.graphs is not None:
            facts.append(f"{v.graphs} graph(s)")
        if v.graph_breaks:
            facts.append(f"{v.graph_breaks} graph break(s)")
        dynamo = dynamo_facts(fm, v.name) if v.compile_count is None else ""
        if dynamo:
            facts.append(dynamo)
        if v.error is not None:
            facts.append(f"build failed at {v.error.stage}: {v.error.message}")
        if v.name != fm.reference and v.error is None:
            facts.append(_agreement(fm, v.name))
        sb = v.second_batch
        if sb:
            if sb.get("error"):
                facts.append(f"second batch: {sb['error']}")
            elif sb.get("mismatched") or sb.get("term_values"):
                stale = (
                    f", stale term values: {', '.join(sb['term_values'])}" if sb.get("term_values") else ""
                )
                facts.append(
                    f"second batch ({sb['scenario']}): {len(sb['mismatched'])} gradient(s) differ{stale}"
                )
            else:
                facts.append(f"second batch: matches ({sb['scenario']})")
        lines.append(f"{v.name}: " + ", ".join(facts))
    return lines


def dynamo_facts(fm: FlowMap, variant: str) -> str:
    """What dynamo did for a path it compiled (whoever called torch.compile): frames, recompiles,
    graph breaks, runs in which compiled code ran. Empty when dynamo compiled nothing."""
    events = (fm.evidence.get("dynamo") or {}).get(variant) or {}
    windows = [w for w in [events.get("build"), *(events.get("runs") or {}).values()] if w]
    compiles = [c for w in windows for c in w.get("compiles") or ()]
    runs = events.get("runs") or {}
    if not compiles and not any(w.get("cache_hits") for w in windows):
        return ""
    parts = [f"dynamo compiled {len(compiles)} frame(s)"]
    recompiles = [c for c in compiles if c.get("reason")]
    if recompiles:
        parts.append(f"{len(recompiles)} recompile(s)")
    breaks = sum(n for w in windows for n in (w.get("graph_breaks") or {}).values())
    if breaks:
        parts.append(f"{breaks} graph break(s)")
    ran = sum(bool(w.get("ran_compiled")) for w in runs.values())
    parts.append(f"compiled code ran in {ran}/{len(runs)} run(s)")
    return ", ".join(parts)


def trial_rows(fm: FlowMap) -> list[tuple[str, str, list[tuple[str, str, str]]]]:
    """Per bisection: (variant, the scenarios it was bisected on, rows of (flip, result, seconds)) from
    ``fm.bisections[*]["trials"]``, each result prefixed by whether the flow matched the reference."""
    out = []
    for b in fm.bisections:
        rows = []
        for t in b.get("trials") or ():
            seconds = t.get("seconds")
            rows.append(
                (
                    str(t.get("change", t.get("knob", "?"))),
                    ("matches: " if t.get("ok") else "does not match: ") + str(t.get("result", "")),
                    f"{seconds:.2f}" if isinstance(seconds, int | float) else "-",
                )
            )
        if rows:
            out.append((str(b.get("variant")), ", ".join(b.get("scenarios") or ()), rows))
    return out


def trial_lines(fm: FlowMap, *, width: int | None = None) -> list[str]:
    """The trial table of each bisection: flip, seconds, result; plain text of at most ``width``
    (default ``report_width()``) columns."""
    return plain_lines(trial_blocks(fm), report_width(width))


def trial_blocks(fm: FlowMap) -> list[Block]:
    """``trial_lines`` as blocks: per bisection, its title and its table."""
    out: list[Block] = []
    for variant, scenarios, rows in trial_rows(fm):
        out.append(visible(f"bisect {variant}" + (f" (on {scenarios})" if scenarios else "") + ":"))
        label = Column("flip", [visible(r[0]) for r in rows], header_style="bold", wrap=False)
        seconds = Column("seconds", [r[2] for r in rows], header_style="bold", justify="right")
        styles = ["green" if r[1].startswith("matches: ") else "red" for r in rows]
        result = Column("result", [visible(r[1]) for r in rows], header_style="bold", styles=styles)
        out.append(Indented(label, [seconds, result]))
    return out


def _agreement(fm: FlowMap, variant: str) -> str:
    """'matches eager on all 56 cells (max rel. error 8.9e-16)', or how many cells differ."""
    cells = [
        c
        for s in fm.scenario_names
        for c in fm.cells_of(variant, s).values()
        if c.parameter in fm.trainable_set
    ]
    failed = sum(fm.run(variant, s).error is not None for s in fm.scenario_names)
    differing = sum(c.verdict not in (None, "match") for c in cells)
    errors = [c.rel_error for c in cells if c.rel_error is not None and not math.isnan(c.rel_error)]
    worst = f" (max rel. error {max(errors):.2g})" if errors else ""
    if failed == len(fm.scenario_names):
        return "every run failed"
    if differing:
        return f"{differing} of {len(cells)} cells differ from {fm.reference}" + worst
    tail = f"; {failed} run(s) failed" if failed else ""
    return f"matches {fm.reference} on all {len(cells)} cells{worst}{tail}"


PASS = ("PASS", "bold green")
FAIL = ("FAIL", "bold red")


def _assemble(*parts: str | tuple[str, str]) -> Text:
    """A line of ``parts``, each a string or (string, style), control characters made visible."""
    from rich.text import Text

    return Text.assemble(*((visible(p[0]), p[1]) if isinstance(p, tuple) else visible(p) for p in parts))


def check_lines(fm: FlowMap) -> list[str]:
    """One line per verification check that ran (consistency, physics, shape sweep, balance, training),
    the balance table's lines as plain text of ``DEFAULT_WIDTH`` columns."""
    return [
        line
        for block in check_blocks(fm)
        for line in (plain_lines([block], DEFAULT_WIDTH) if isinstance(block, Indented) else [str(block)])
    ]


def check_blocks(fm: FlowMap) -> list[str | Text | Indented]:
    """``check_lines`` as blocks: its lines, and the balance check's table (each group's share of the
    gradient norm, by term) as a table."""
    checks = fm.checks
    lines: list[str | Text | Indented] = []
    c = checks.get("consistency")
    if c:
        parts = []
        for v, r in c["variants"].items():
            # A path compared at a lower precision's tolerance (autocast: its knob, or observed) says so.
            at = f", at <= {r['rtol']:g}" if r.get("rtol") is not None else ""
            if r["passed"]:
                parts.append(_assemble(f"{v}: ", PASS, f" ({r['checked_cells']} cells{at})"))
            else:
                worst = r["worst"][0] if r["worst"] else None
                error = worst.get("rel_error") if worst else None
                detail = (
                    f", worst {worst['parameter']} in {worst['scenario']}"
                    + (f" (relative error {error:.2g})" if error is not None else "")
                    if worst
                    else ""
                )
                failed = f"{r['failed_cells']}/{r['checked_cells']} cells" if r["checked_cells"] else "no run"
                terms = f", {len(r['terms'])} term value(s)" if r["terms"] else ""
                parts.append(_assemble(f"{v}: ", FAIL, f" {failed}{terms}{detail}{at}"))
        # The same measure as the table's '!' (relative L1 error per parameter, the run's noise floor),
        # at a tighter rtol: a cell the table marks fails here too.
        rtol = c.get("rtol")
        table = f", the table's '!' at {fm.rtol:g}" if fm.rtol is not None else ""
        lines.append(
            _assemble(
                f"consistency vs {fm.reference} (relative L1 error per parameter <= {rtol:g}{table}, above "
                "the noise floor): "
            )
            + _assemble("; ").join(parts)
        )
    g = checks.get("gradients")
    if g and not g.get("error"):
        lines.extend(_gradients_lines(g))
    for name in ("physics", "balance", "training", "metrics", "backends", "gradients"):  # a check that raised
        result = checks.get(name)
        if isinstance(result, dict) and result.get("error"):
            lines.append(f"{name}: could not run — {result['error']}")
    p = checks.get("physics")
    if p and not p.get("error"):
        head = PASS if p["passed"] else FAIL
        parts = [
            f"force vs -dE/dx {p['force']['max_rel_error']:.2g}",
            f"sum rule {p['sum_rule']['relative']:.2g}",
        ]
        if "virial" in p:
            parts.append(f"virial vs strain {p['virial']['max_rel_error']:.2g}")
        precision = p.get("precision") or {}
        if precision.get("detectable") is not None:
            parts.append(f"detects forces off by {precision['detectable']:.2g} or more")
        lines.append(
            _assemble(
                f"physics ({p['samples']} finite-difference samples, {precision.get('dtype', 'float64')}): ",
                head,
                " — " + ", ".join(parts),
            )
        )
        if precision.get("why"):  # not a float64 copy: on what, in which precision, and why
            lines.append(f"  on {precision['on']}, in {precision['dtype']}: {precision['why']}")
        lines.extend(f"  {failure}" for failure in p["failures"])
    for v, r in (checks.get("physics_paths") or {}).items():
        if r.get("skipped") or r.get("error"):
            lines.append(f"physics, {v}: not run — {r.get('skipped') or r.get('error')}")
            continue
        parts = [
            f"force vs -dE/dx {r['force']['max_rel_error']:.2g}",
            f"sum rule {r['sum_rule']['relative']:.2g}",
        ]
        if "virial" in r:
            parts.append(f"virial vs strain {r['virial']['max_rel_error']:.2g}")
        if r.get("outputs"):
            parts.append(
                "outputs vs the reference's " + ", ".join(f"{k} {e:.2g}" for k, e in r["outputs"].items())
            )
        lines.append(
            _assemble(
                f"physics, {v} (its own forces): ", PASS if r["passed"] else FAIL, " — " + ", ".join(parts)
            )
        )
        lines.extend(f"  {failure}" for failure in r["failures"])
    lines.extend(_trainer_check_lines(checks))
    for v, entry in (checks.get("shape_sweep") or {}).items():
        result = entry["error"] or (
            f"{len(entry['mismatched'])} gradient(s) differ" if entry["mismatched"] else "matches eager"
        )
        lines.append(f"shape sweep, {v}: {result}")
    b = checks.get("balance")
    if b and not b.get("error"):
        groups = [g for g in b["groups"] if any(b["norms"][t][g] > 0 for t in b["norms"])]
        lines.append("balance: share of each group's gradient norm, by term (at the step's prefactors):")
        shares = b["shares"]
        label = Column("term", [visible(t) for t in shares], wrap=False)
        columns = [
            Column(
                visible(g),
                [f"{shares[t][g]:.1%}" if b["norms"][t][g] > 0 else "-" for t in shares],
                least=7,
            )
            for g in groups
        ]
        lines.append(Indented(label, columns))
        update = (b.get("effective_update") or {}).get("terms") or {}
        if update:
            lines.append(
                f"  one {b['effective_update']['optimizer']} step, each term alone vs all together (cosine): "
                + ", ".join(f"{t} {u['cosine_with_joint']:.2f}" for t, u in update.items())
            )
        lines.extend(
            f"  balance ({part}): could not run — {error}" for part, error in (b.get("errors") or {}).items()
        )
    t = checks.get("training")
    if t and not t.get("error"):
        lines.append(f"training ({t['steps']} {t['optimizer']} steps per term, on {t.get('on', 'a copy')}):")
        if t.get("why"):
            lines.append(f"  {t['why']}")
        for v, verdicts in t["verdicts"].items():
            gap = t["divergence_from_reference"].get(v)
            tail = f" — trajectory differs from {fm.reference} by up to {gap:.2g}" if gap else ""
            lines.append(
                f"  {v}: " + ", ".join(f"{term} {verdict}" for term, verdict in verdicts.items()) + tail
            )
    return lines


def _gradients_lines(g: dict[str, Any]) -> list[str]:
    """The gradients check (finite differences of each term's value against autograd's directional
    derivative): its cost, then per path on what and at which resolution, and each term's verdict. A
    term off here is not by itself an error: the findings say which cut it is and how serious."""
    out = [f"gradients vs finite differences ({g['seconds']:.1f} s of a {g['budget_s']:g} s budget):"]
    for path, r in (g.get("paths") or {}).items():
        words = []
        for term, e in (r.get("terms") or {}).items():
            status = e.get("status")
            if status == "agrees":
                words.append(f"{term} agrees")
            elif status == "disagrees":
                along = e.get("parameters") or []
                words.append(
                    f"{term} off by {e['rel_error']:.0%}" + (f" along {names(along)}" if along else "")
                )
            elif status == "undecided":
                words.append(f"{term} undecided (the value is not smooth there)")
            else:
                words.append(f"{term} not checked ({e.get('reason', status)})")
        note = f" — {r['note']}" if r.get("note") else ""
        out.append(
            f"  {path} (on {r['on']}, {r['dtype']}, detects {r['detectable']:g} or more{note}): "
            + "; ".join(words)
        )
    return out


def _metric_parts(metrics: dict[str, Any]) -> list[str]:
    """'pt_expt rmse_e ×1, ..., rmse_v ×6' : each path's reported metrics over the recomputed ones."""
    return [
        f"{path} " + ", ".join(f"{m} ×{r['factor']:.6g}" for m, r in rows.items())
        for path, rows in (metrics.get("paths") or {}).items()
        if rows
    ]


def _trainer_check_lines(checks: dict[str, Any]) -> list[Any]:
    """A trainer adapter's own checks (DeePMD): its metrics against the documented definitions, and
    its two backends on the same weights."""
    lines: list[Any] = []
    m = checks.get("metrics")
    if isinstance(m, dict) and not m.get("error"):
        lines.append(
            _assemble(
                f"metrics vs their documented definitions (natoms {m.get('natoms')}, within {m['rtol']:g}): ",
                PASS if m["passed"] else FAIL,
                " — reported/recomputed: " + "; ".join(_metric_parts(m)),
            )
        )
    b = checks.get("backends")
    if isinstance(b, dict) and not b.get("error"):
        parts = [
            "outputs "
            + ", ".join(f"{k} {e:.2g}" for k, e in b["outputs"].items())
            + f" (<= {b['rtol_outputs']:g})",
            "gradients per serialized variable "
            + ", ".join(f"{t} {g['max_rel_error']:.2g}" for t, g in b["grads"].items())
            + f" (<= {b['rtol_grads']:g})",
        ]
        if b.get("metrics"):
            parts.append("metrics " + "; ".join(_metric_parts(b["metrics"])))
        lines.append(
            _assemble(
                f"backends, {b['other']} vs {b['reference']} ({b['via']}): ",
                PASS if b["passed"] else FAIL,
                " — " + ", ".join(parts),
            )
        )
        lines.extend(f"  {failure}" for failure in b.get("failures") or ())
    return lines


def finding_lines(finding: Finding) -> list[str]:
    lines = [f"{finding.severity.upper()} {finding.cause}: {finding.message}"]
    if finding.fix:
        lines.append(f"  fix: {finding.fix}")
    return lines


def verdict(fm: FlowMap) -> str:
    counts = {sev: sum(f.severity == sev for f in fm.findings) for sev in ("error", "warning", "info")}
    if counts["error"]:
        head = f"PROBLEM: {counts['error']} error(s)"
    elif counts["warning"]:
        head = f"check: {counts['warning']} warning(s)"
    else:
        head = "OK: no problem found"
    extra = [f"{n} {sev}" for sev, n in counts.items() if n and not (sev == "error" and counts["error"])]
    return head + (f" ({', '.join(extra)})" if extra and not head.startswith("check") else "")


def render(fm: FlowMap, *, show_all: bool = False, width: int | None = None) -> str:
    """The whole terminal report as plain text: verdict and serious findings first, then the table,
    then details. Its tables fit ``width`` (else ``COLUMNS``, else ``DEFAULT_WIDTH``); lines of prose
    wrap at ``width`` when one is given (a terminal's), and are left whole otherwise (a file, a pipe:
    one line per statement, for grep)."""
    console = plain_console(report_width(width))
    print_report(console, fm, show_all=show_all, wrap=width is not None)
    return console.file.getvalue()  # type: ignore[attr-defined,no-any-return]


def print_report(console: Console, fm: FlowMap, *, show_all: bool = False, wrap: bool = True) -> None:
    """The report's renderables on ``console`` (the one render path of the plain and the coloured
    report): prose word-wrapped at the console's width when ``wrap``, tables fitted to it always."""
    from rich.text import Text

    def say(text: Text | str = "") -> None:
        text = Text(text) if isinstance(text, str) else text
        # Wrapped here, not by print: the same lines in both looks, none with a space left at its end.
        for line in text.wrap(console, console.width) if wrap else [text]:
            line.rstrip()
            console.print(line, soft_wrap=True)

    head = verdict(fm)
    style = (
        "bold red"
        if head.startswith("PROBLEM")
        else "bold yellow"
        if head.startswith("check")
        else "bold green"
    )
    say(Text.assemble(("gradprobe: ", "bold"), (head, style)))
    say()
    serious = [f for f in fm.findings if f.severity != "info"]
    for f in serious:
        say(finding_text(f))
    if serious:
        say()
    say(Text(visible(table_title(fm)), style="dim"))
    for i, table in enumerate(tables(*summary_columns(fm), console.width, roomy=SUMMARY_ROOMY)):
        if i:
            say()
        print_table(console, table)
    footer = table_footer(fm)
    if footer:
        say(Text(visible(footer), style="red"))
    for block in details_blocks(fm, show_all=show_all):
        if isinstance(block, Indented):
            for table in tables(block.label, block.columns, console.width - block.indent):
                print_table(console, table, indent=block.indent)
        else:
            say(Text(visible(block)) if isinstance(block, str) else block)


def finding_text(f: Finding) -> Text:
    """A finding's lines (``finding_lines``): the severity coloured, the cause bold, the fix cyan."""
    from rich.text import Text

    first, *rest = finding_lines(f)
    text = Text()
    text.append(visible(f.severity.upper()), SEVERITY_STYLE.get(f.severity, ""))
    text.append(" ")
    text.append(visible(f.cause), "bold")
    text.append(visible(first[len(f.severity) + 1 + len(f.cause) :]))
    for line in rest:
        text.append("\n")
        if line.startswith("  fix: "):
            text.append("  fix: ", "bold cyan")
            text.append(visible(line[len("  fix: ") :]))
        else:
            text.append(visible(line))
    return text


def details_lines(fm: FlowMap, *, show_all: bool = False, width: int | None = None) -> list[str]:
    """``details_blocks`` as plain lines, tables of at most ``width`` (default ``report_width()``)."""
    return plain_lines(details_blocks(fm, show_all=show_all), report_width(width))


def details_blocks(fm: FlowMap, *, show_all: bool = False) -> list[Block]:
    """Everything after the table: what the differences mean, what the reference does not reach, the
    variants' build facts, the checks, the bisections' trials, the per-parameter diffs, warnings and
    info findings."""
    info = [f for f in fm.findings if f.severity == "info"]
    out: list[Block] = []
    interp = interpretation_lines(fm)
    if interp:
        out.append("")
        out.extend(interp)
    out.append("")
    out.extend(meaning_lines(fm))
    facts = variant_lines(fm)
    if facts:
        out.append("")
        out.extend(facts)
    try:
        checked = check_blocks(fm)
    except (KeyError, TypeError, AttributeError, ValueError):  # a saved map with checks of another shape
        checked = ["(the checks section of this flow map could not be read)"]
    if checked:
        out.extend(["", "checks:"])
        out.extend(
            Indented(b.label, b.columns, b.indent + 2)
            if isinstance(b, Indented)
            else f"  {b}"
            if isinstance(b, str)
            else _assemble("  ") + b
            for b in checked
        )
    trials = trial_blocks(fm)
    if trials:
        out.append("")
        out.extend(trials)
    diffs = [
        block
        for v in fm.variant_names
        if v != fm.reference
        for s in fm.scenario_names
        if fm.cells_of(v, s) and (show_all or fm.differences(v, s))
        for block in [*diff_blocks(fm, v, s, show_all=show_all), ""]
    ]
    if diffs:
        out.append("")
        out.extend(diffs[:-1])
    for w in fm.warnings:
        out.extend(["", _assemble(("WARNING", SEVERITY_STYLE["warning"]), f" {w}")])
    if info:
        out.append("")
        for f in info:
            out.append(finding_text(f))
    return out
