"""The styled terminal report: rich on a terminal (colours, the failing cells and columns in red, the
width respected), ``render(fm)`` byte for byte when piped, the same text as the coloured one."""

from __future__ import annotations

import io
import re

import pytest
from test_report_terminal import assert_headers_whole, many_variant_map, two_variant_map

from gradprobe.report.styled import write_report
from gradprobe.report.terminal import render

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def terminal_env(monkeypatch):  # type: ignore[no-untyped-def]
    for name in ("NO_COLOR", "FORCE_COLOR", "CI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setenv("COLUMNS", "72")


def test_piped_output_is_the_plain_report() -> None:
    fm = two_variant_map()
    out = io.StringIO()
    write_report(fm, out)
    assert out.getvalue() == render(fm)


def test_on_a_terminal_the_failing_cell_and_its_column_are_red(terminal_env) -> None:  # type: ignore[no-untyped-def]
    fm = two_variant_map()
    out = Terminal()
    write_report(fm, out)
    styled = out.getvalue()
    assert "\x1b[" in styled
    red = "\x1b[1;31m"
    assert f"{red}error: double" in styled  # the failed run's cell
    assert f"{red}make_fx" in styled  # the header of the column that holds it
    assert f"{red}eager" not in styled  # the healthy reference column is not
    assert "\x1b[1;32mOK: no problem found" in styled  # the verdict, green
    plain = ANSI.sub("", styled)
    assert "problem cells: 1 failed (error), of 4 runs" in plain
    assert "force only: 1 not reached: c.w (head used by energy only)" in plain
    assert all(len(line) <= 72 for line in plain.splitlines()), plain  # fits the terminal's width


def test_no_color_gives_the_plain_report(terminal_env, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("NO_COLOR", "1")
    fm = two_variant_map()
    out = Terminal()
    write_report(fm, out)
    assert out.getvalue() == render(fm, width=72)  # at the terminal's width (its COLUMNS)


@pytest.mark.parametrize("width", ["80", "120"])
def test_on_a_terminal_tables_fit_and_headers_break_only_between_stages(
    terminal_env, monkeypatch, width
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("COLUMNS", width)
    out = Terminal()
    write_report(many_variant_map(), out)
    plain = ANSI.sub("", out.getvalue())
    assert all(len(line) <= int(width) for line in plain.splitlines()), plain
    assert_headers_whole(plain)


@pytest.mark.parametrize("fm", [two_variant_map(), many_variant_map()], ids=["two", "many"])
def test_the_coloured_report_carries_the_plain_reports_text(terminal_env, fm) -> None:  # type: ignore[no-untyped-def]
    out = Terminal()
    write_report(fm, out)
    styled = out.getvalue()
    assert "\x1b[" in styled
    assert ANSI.sub("", styled) == render(fm, width=72)  # the terminal_env's COLUMNS
