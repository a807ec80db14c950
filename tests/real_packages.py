"""Helpers of the real-package tests of the potential adapter (issue 33): the example scripts as
modules, the user code they hold counted, and behaviours measured on torch 2.13 asserted so that a
newer torch that no longer has one says so (an xfail naming it) instead of failing without a word."""

from __future__ import annotations

import ast
import inspect
from typing import Any

import pytest
import torch

MEASURED_ON = "2.13."


def torch_behaviour(present: bool, what: str) -> None:
    """``what`` (a behaviour of torch 2.13 the table in docs/trainers.md records) is still there."""
    if present:
        return
    if not torch.__version__.startswith(MEASURED_ON):
        pytest.xfail(f"torch {torch.__version__} no longer shows a behaviour measured on torch 2.13: {what}")
    raise AssertionError(f"torch {torch.__version__}: expected {what} (measured on torch 2.13)")


def user_lines(function: Any) -> int:
    """Lines of code in a function's body: no signature, docstring, comments or blank lines."""
    source = inspect.getsource(function)
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    lines = source.splitlines()
    code = lines[body[0].lineno - 1 : body[-1].end_lineno]
    return sum(1 for line in code if line.strip() and not line.strip().startswith("#"))


def errors(fm: Any) -> list[str]:
    return sorted({f.cause for f in fm.findings if f.severity == "error"})


def finding(fm: Any, cause: str) -> Any:
    (found,) = [f for f in fm.findings if f.cause == cause]
    return found
