"""Dynamo's own record of what a path did, whoever called ``torch.compile``.

While a ``Watch`` is active, each window (a variant's build, each scenario's run) collects:

* the frames dynamo compiled (``torch._dynamo.utils.get_compilation_metrics()``), each with dynamo's
  recompile reason, i.e. the guard that failed and the user's line (``w == 1.0`` at ``step.py:14``),
  and the failure type of a compile that raised;
* cache hits and misses from the guard-complete hook (``torch._C._dynamo.eval_frame``): a hit means
  compiled code ran; a run with neither a hit nor a compile ran no compiled code at all;
* graph breaks with dynamo's reasons (``counters["graph_break"]``), and per compiled frame the breaks
  that made dynamo restart it (its ``restart_reasons``), each with its frame: the line where the frame
  broke, read from the resume function dynamo compiled next (``torch_dynamo_resume_in_f_at_N``).

Nothing here needs the path's cooperation; a counter or graph the path hands over only sharpens it.
The hook is process-wide: the previous one is chained and put back when the watch ends.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .grad_calls import GradCalls

_RESUME = re.compile(r"^torch_dynamo_resume_in_(?P<name>.+)_at_(?P<line>\d+)$")
BREAK_REASON_CHARS = 1200  # a graph break's reason as dynamo words it, explanation and hints included
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>[^\n]+)\n\s*(?P<code>[^\n]*)')


@dataclass
class Window:
    """What dynamo did during one window."""

    name: str
    compiles: list[dict[str, Any]] = field(default_factory=list)
    cache_hits: int = 0
    cache_misses: int = 0
    graph_breaks: dict[str, int] = field(default_factory=dict)
    grad_calls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ran_compiled(self) -> bool:
        """Compiled code ran: a guard check found a cache entry, or a frame was compiled (and then run)."""
        return self.cache_hits > 0 or any(c["ok"] for c in self.compiles)

    @property
    def recompiles(self) -> list[dict[str, Any]]:
        return [c for c in self.compiles if c.get("reason")]

    def to_dict(self) -> dict[str, Any]:
        return {
            "compiles": self.compiles,
            "cache_hits": self.cache_hits,
            "cache_misses": self.cache_misses,
            "graph_breaks": self.graph_breaks,
            "ran_compiled": self.ran_compiled,
            **({"grad_calls": self.grad_calls} if self.grad_calls else {}),
        }


def parse_reason(text: str) -> dict[str, Any]:
    """Dynamo's recompile reason: the failed guard and the innermost user frame it names."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    guard = re.sub(r"^\d+/\d+:\s*", "", first).split("  #", 1)[0].strip()
    frames = [m.groupdict() for m in _FRAME.finditer(text)]
    out: dict[str, Any] = {"guard": guard, "text": text.strip()[:600]}
    if frames:
        f = frames[-1]
        out.update(file=f["file"], line=int(f["line"]), code=f["code"].strip())
    return out


def _compile_entry(m: Any) -> dict[str, Any]:
    reason = getattr(m, "recompile_reason", None)
    entry: dict[str, Any] = {
        "frame": m.co_name,
        "file": m.co_filename,
        "line": m.co_firstlineno,
        "ok": m.fail_type is None and bool(getattr(m, "has_guarded_code", True)),
        "fail_type": m.fail_type,
        "fail_reason": (m.fail_reason or "")[:400] or None,
        "graph_breaks": getattr(m, "num_graph_breaks", None),
        "reason": None,
        "breaks": [
            {"reason": str(r).strip()[:BREAK_REASON_CHARS]}
            for r in sorted(getattr(m, "restart_reasons", None) or ())
        ],
    }
    if reason:
        entry["reason"] = parse_reason(reason)
    return entry


def _break_frames(compiles: list[dict[str, Any]]) -> None:
    """Each graph break's frame: a frame that broke at line N is resumed by a function dynamo compiles
    as ``torch_dynamo_resume_in_<name>_at_<N>``; a frame's breaks take, in order, the resume lines of
    the same function and file past the frame's own start."""
    resumes: dict[tuple[Any, str], list[int]] = {}
    for c in compiles:
        m = _RESUME.match(c.get("frame") or "")
        if m:
            resumes.setdefault((c.get("file"), m["name"]), []).append(int(m["line"]))
    for c in compiles:
        if not c.get("breaks") or not c.get("frame"):
            continue
        m = _RESUME.match(c["frame"])
        name, start = (m["name"], int(m["line"])) if m else (c["frame"], c.get("line") or 0)
        lines = sorted(n for n in resumes.get((c.get("file"), name), ()) if n > start)
        for b, line in zip(c["breaks"], lines or [None] * len(c["breaks"]), strict=False):
            b.update(file=c.get("file"), function=name, line=line if line is not None else c.get("line"))
            if b["file"] and b["line"] and os.path.exists(b["file"]):
                b["code"] = linecache.getline(b["file"], b["line"]).strip()


def _find_hook_setter() -> Any:
    try:
        from torch._C._dynamo.eval_frame import set_guard_complete_hook
    except ImportError:
        return None
    return set_guard_complete_hook


_HOOK_SETTER = _find_hook_setter()  # looked up once: an import per window costs more than the window


def _hook_setter() -> Any:
    return _HOOK_SETTER


class Watch:
    """Collects dynamo's events in named windows; ``with Watch() as w: with w.window("build"): ...``."""

    def __init__(self) -> None:
        self.windows: dict[str, Window] = {}
        self._current: Window | None = None
        self._previous_hook: Any = None
        self._installed = False

    def __enter__(self) -> Watch:
        hook = _hook_setter()
        if hook is not None:  # torch < 2.6 has no guard-complete hook: compiles are still recorded
            self._previous_hook = hook(self._hook)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        hook = _hook_setter()
        if self._installed and hook is not None:
            hook(self._previous_hook)
            self._installed = False

    def _hook(self, cache_hit: bool) -> bool:
        if self._current is not None:
            if cache_hit:
                self._current.cache_hits += 1
            else:
                self._current.cache_misses += 1
        previous = self._previous_hook
        return previous(cache_hit) if previous is not None else cache_hit

    @contextlib.contextmanager
    def window(self, name: str) -> Iterator[Window]:
        # Dynamo's own records, read from its module where something imported it (a step may import
        # it inside the window: then everything it recorded is new); never imported here.
        window = Window(name)
        utils = sys.modules.get("torch._dynamo.utils")
        seen = {id(m) for m in utils.get_compilation_metrics()} if utils is not None else set()
        breaks = dict(utils.counters["graph_break"]) if utils is not None else {}
        outer, self._current = self._current, window
        calls = GradCalls()
        try:
            with calls.installed():
                yield window
        finally:
            window.grad_calls = calls.calls
            self._current = outer
            utils = sys.modules.get("torch._dynamo.utils")
            if utils is not None:
                window.compiles = [
                    _compile_entry(m) for m in utils.get_compilation_metrics() if id(m) not in seen
                ]
                _break_frames(window.compiles)
                window.graph_breaks = {
                    reason.strip().splitlines()[0][:300]: n - breaks.get(reason, 0)
                    for reason, n in utils.counters["graph_break"].items()
                    if n > breaks.get(reason, 0)
                }
            self.windows[name] = window

    def to_dict(self) -> dict[str, Any]:
        build = self.windows.get("build")
        return {
            "build": build.to_dict() if build is not None else None,
            "runs": {n: w.to_dict() for n, w in self.windows.items() if n != "build"},
        }
