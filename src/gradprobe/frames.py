"""Where in the user's code: the user's frame of an exception, a printed traceback or an FX node's
stack trace.

A user file is any file outside torch and gradprobe, gradprobe's zoo included (reference models
written like user code), and FX's generated code (``<eval_with_key>``: a traced graph replayed).
Python's standard library is never the user's frame of a failure (a ``contextlib`` wrapper is not
where the user's code went wrong), nor is the import machinery (``<frozen importlib._bootstrap>``,
any ``<frozen ...>`` module, ``importlib``): an import that failed is reported where the user's code
imported, never at ``<frozen importlib._bootstrap>:1140``.
"""

from __future__ import annotations

import ast
import functools
import linecache
import os
import re
import sysconfig
from typing import Any

import torch

TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
FX_CODE = "<eval_with_key>"  # the file name of an FX graph's generated code
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_ZOO_DIR = os.path.join(_OWN_DIR, "zoo") + os.sep

FRAMES = 12  # innermost traceback frames kept with a run error

# One frame of a printed traceback: its header line, then (indented) its source line.
_FRAME = re.compile(
    r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>[^\n]+)\n\s*(?P<code>[^\n]*)'
)


def is_import_machinery(path: str) -> bool:
    """A frozen module (``<frozen importlib._bootstrap>``, ``<frozen runpy>``) or a file of ``importlib``:
    Python's own machinery, never where the user's code is."""
    path = path.replace("\\", "/")
    return path.startswith("<frozen ") or "/importlib/" in path or "/importlib_metadata/" in path


@functools.cache
def is_user_file(path: str) -> bool:
    """User code: outside torch and gradprobe, except the zoo (reference models written like user code);
    never the import machinery."""
    if path.startswith(FX_CODE):
        return True
    if is_import_machinery(path):
        return False
    path = os.path.abspath(path)
    return path.startswith(_ZOO_DIR) or not path.startswith((TORCH_DIR, _OWN_DIR))


def _is_stdlib(path: str) -> bool:
    """A file of Python's standard library (contextlib, functools...): never the user's frame."""
    path = os.path.abspath(path)
    stdlib = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
    return path.startswith(stdlib) and "site-packages" not in path and "dist-packages" not in path


def frames_of(e: BaseException, limit: int = FRAMES) -> tuple[str, ...]:
    """``"runtime_wrappers.py:2489 in coerce_to_expected_memory_format"`` for the innermost ``limit``
    frames of the traceback (torch's included), innermost last."""
    out: list[str] = []
    tb = e.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        out.append(f"{os.path.basename(code.co_filename)}:{tb.tb_lineno} in {code.co_name}")
        tb = tb.tb_next
    return tuple(out[-limit:])


def user_frame_of(e: BaseException) -> dict[str, Any] | None:
    """The user's frame of a failure: the last frame dynamo's message names ("from user code: File
    ..."), else the innermost traceback frame outside torch and gradprobe."""
    named = user_frame_in_text(str(e))
    if named is not None:
        return named
    found = None
    tb = e.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        file = code.co_filename
        if is_user_file(file) and not file.startswith(FX_CODE) and not _is_stdlib(file):
            found = tb
        tb = tb.tb_next
    if found is None:
        return None
    code = found.tb_frame.f_code
    file, line = code.co_filename, found.tb_lineno
    out: dict[str, Any] = {"file": file, "line": line, "function": code.co_name,
                           "code": linecache.getline(file, line).strip()}  # fmt: skip
    owner = found.tb_frame.f_locals.get("self") if code.co_varnames[:1] == ("self",) else None
    if owner is not None:
        out["object_type"] = f"{type(owner).__module__}.{type(owner).__qualname__}"
    return out


def user_frame_in_text(text: str) -> dict[str, Any] | None:
    """The innermost user frame a printed traceback names (``File "...", line N, in f``)."""
    named = [
        m.groupdict() for m in _FRAME.finditer(text) if is_user_file(m["file"]) and not _is_stdlib(m["file"])
    ]
    if not named:
        return None
    f = named[-1]
    file, line = f["file"], int(f["line"])
    code = f["code"].strip()
    if code.startswith('File "'):  # the frame printed no source line: the next frame's header was taken
        code = linecache.getline(file, line).strip()
    if not code or code[0] in ")]}":
        # A resumed dynamo frame may name the line after a multi-line call: the statement it ends.
        line, code = _statement_before(file, line)
    return {"file": file, "line": line, "function": f["function"].strip(), "code": code}


def user_frame_in_stack_trace(stack_trace: str | None) -> dict[str, Any] | None:
    """The innermost frame of an FX node's stack trace (``node.meta["stack_trace"]``) that is not
    torch's or gradprobe's own machinery (the zoo is the user's)."""
    if not stack_trace:
        return None
    for f in reversed([m.groupdict() for m in _FRAME.finditer(stack_trace)]):
        path = f["file"].replace("\\", "/")
        if "/torch/" in path or ("/gradprobe/" in path and "/gradprobe/zoo/" not in path):
            continue
        if is_import_machinery(path):
            continue
        return {"file": f["file"], "line": int(f["line"]), "function": f["function"].strip(),
                "code": f["code"].strip()}  # fmt: skip
    return None


def _statement_before(file: str, line: int) -> tuple[int, str]:
    """The first line (number and text) of the innermost statement that holds ``line``, or of the last
    one ending before it when ``line`` is blank; ``(line, "")`` when the file cannot be read."""
    source = "".join(linecache.getlines(file))
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return line, ""
    best = None
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and node.end_lineno is not None and node.lineno <= line:
            holds = node.end_lineno >= line
            ends_before = node.end_lineno < line and not linecache.getline(file, line).strip()
            if (holds or ends_before) and (
                best is None or (node.lineno, -node.end_lineno) > (best.lineno, -best.end_lineno)
            ):
                best = node
    if best is None:
        return line, ""
    return best.lineno, linecache.getline(file, best.lineno).strip()
