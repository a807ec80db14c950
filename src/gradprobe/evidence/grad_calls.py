"""The ``autograd.grad(..., create_graph=True)`` calls a path made while it ran, and whether each result
carried a graph — whoever made the call, inside a compiled region or not.

A force computed inside a compiled model (``torch.autograd.grad(E, pos, create_graph=self.training)``)
can come back with the right values and no gradient path: nothing raises. The only direct fact is the
call itself: grad mode on, the differentiated outputs carrying a graph, ``create_graph=True``, and a
result without one. The recorder wraps ``torch.autograd._engine_run_backward`` (what ``autograd.grad``
calls; torch patches it the same way for non-strict ``make_fx``) while a window is open, chained over
whatever was installed before and put back after; the wrapper is kept out of dynamo
(``torch._dynamo.disable``) so that a compiled path runs exactly as it would without it. Dynamo graph-breaks
on ``autograd.grad`` (``trace_autograd_ops=False``), so the call runs in Python and is seen; a call dynamo
traces into its graph is not seen (and is not the case here).

For a result that came back without a graph, whether it is non-zero (None or exact zeros are an input
the outputs never used: another fault) and the autograd graph it differentiated is walked for custom
``autograd.Function`` nodes that ``torch.compile`` traced (their backward is an FX graph, dynamo's
``autograd_function_apply``): where that traced backward switches grad mode off, its second derivative
is lost, and the line that applied the Function and the line of its ``backward`` are read from the
traced graph's own stack traces.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

_RESUME = re.compile(r"^torch_dynamo_resume_in_(?P<name>.+)_at_\d+$")
_STACK = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')
MAX_NODES = 200_000  # an autograd graph walk stops there
MAX_CALLS = 32  # distinct call sites kept per window


def _torch_dir() -> str:
    import torch

    return os.path.dirname(torch.__file__) + os.sep  # not torchmdnet/, torchani/, ...


def _caller(start: Any) -> dict[str, Any]:
    """The first frame outside torch and this module: the line that called ``autograd.grad`` (a frame
    dynamo resumed after its graph break is named by the function it resumes)."""
    torch_dir, me = _torch_dir(), __file__
    f = start
    while f is not None and (f.f_code.co_filename.startswith(torch_dir) or f.f_code.co_filename == me):
        f = f.f_back
    if f is None:
        return {}
    file, line = f.f_code.co_filename, f.f_lineno
    m = _RESUME.match(f.f_code.co_name)
    out: dict[str, Any] = {"file": file, "line": line, "function": m["name"] if m else f.f_code.co_name}
    code = linecache.getline(file, line).strip() if line else ""
    if code:
        out["code"] = code
    return out


def _site(stack_trace: str | None) -> dict[str, Any] | None:
    """The innermost ``File ..., line N, in f`` of a traced node's stack trace, with its code."""
    frames = list(_STACK.finditer(stack_trace or ""))
    if not frames:
        return None
    f = frames[-1]
    out: dict[str, Any] = {"file": f["file"], "line": int(f["line"]), "function": f["func"]}
    code = linecache.getline(f["file"], int(f["line"])).strip()
    if code:
        out["code"] = code
    return out


def _traced_backward(node: Any) -> dict[str, Any] | None:
    """What a custom Function node's traced backward is: grad mode off or not, where it was applied and
    where its backward is; None for a Function whose backward is not a traced FX graph."""
    import torch
    from torch.fx import GraphModule

    cls = getattr(node, "_forward_cls", None)
    backward = getattr(cls, "backward", None)
    cells = getattr(backward, "__closure__", None) or ()
    graphs = [c.cell_contents for c in cells if isinstance(_content(c), GraphModule)]
    if not graphs:
        return None
    gm = graphs[0]
    off = applied = at = None
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch._C._set_grad_enabled:
            off = off or (tuple(n.args) == (False,))
            continue
        trace = n.meta.get("stack_trace")
        if n.op == "placeholder" and applied is None:
            applied = _site(trace)
        elif n.op == "call_function" and at is None:
            at = _site(trace)
    return {"grad_off": bool(off), "applied_at": applied, "backward_at": at}


def _content(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def traced_functions(outputs: Any) -> list[dict[str, Any]]:
    """The custom Functions torch.compile traced on the autograd graph behind ``outputs``."""
    import torch

    roots = [o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    seen: set[int] = set()
    found: list[dict[str, Any]] = []
    stack = list(roots)
    while stack and len(seen) < MAX_NODES:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        t = _traced_backward(n)
        if t is not None and t not in found:
            found.append(t)
        stack.extend(f for f, _ in getattr(n, "next_functions", ()) or ())
    return found


class GradCalls:
    """Records ``autograd.grad(create_graph=True)`` calls into the list ``calls`` while installed."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def _record(self, outputs: Any, create_graph: bool, result: Any, frame: Any) -> None:
        import torch
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        outs = [o for o in outputs if isinstance(o, torch.Tensor)]
        res = [r for r in result or () if isinstance(r, torch.Tensor)]
        entry: dict[str, Any] = {
            **_caller(frame),
            "create_graph": bool(create_graph),
            "grad_enabled": torch.is_grad_enabled(),
            "outputs_graph": any(o.requires_grad for o in outs),
            "result_graph": any(r.requires_grad for r in res),
        }
        key = tuple(entry.get(k) for k in ("file", "line", "grad_enabled", "outputs_graph", "result_graph"))
        for c in self.calls:
            if (
                tuple(c.get(k) for k in ("file", "line", "grad_enabled", "outputs_graph", "result_graph"))
                == key
            ):
                c["calls"] += 1
                return
        if len(self.calls) >= MAX_CALLS:
            return
        if entry["grad_enabled"] and entry["outputs_graph"] and not entry["result_graph"]:
            # A result of None or exact zeros (an input the outputs never used) is another fault: said
            # apart. Read only outside any dispatch mode (never inside a trace).
            if _get_current_dispatch_mode() is None:
                entry["result_nonzero"] = any(bool(r.detach().ne(0).any()) for r in res)
            entry["traced_functions"] = traced_functions(outs)
        entry["calls"] = 1
        self.calls.append(entry)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Wrap ``torch.autograd._engine_run_backward`` while open; nothing when dynamo is not loaded
        (no compiled code can run then) or when the wrapper cannot be kept out of dynamo."""
        autograd = sys.modules.get("torch.autograd")
        dynamo = sys.modules.get("torch._dynamo")
        previous = getattr(autograd, "_engine_run_backward", None)
        if autograd is None or dynamo is None or previous is None or getattr(previous, "_gradprobe", False):
            yield
            return

        def run_backward(t_outputs: Any, *args: Any, **kwargs: Any) -> Any:
            result = previous(t_outputs, *args, **kwargs)
            create_graph = args[2] if len(args) > 2 else kwargs.get("create_graph", False)
            if create_graph and not kwargs.get("accumulate_grad", False):
                with contextlib.suppress(Exception):  # evidence never breaks the user's step
                    self._record(t_outputs, create_graph, result, sys._getframe(1))
            return result

        wrapped = dynamo.disable(run_backward)
        wrapped._gradprobe = True  # type: ignore[attr-defined]
        autograd._engine_run_backward = wrapped
        try:
            yield
        finally:
            if autograd._engine_run_backward is wrapped:
                autograd._engine_run_backward = previous
