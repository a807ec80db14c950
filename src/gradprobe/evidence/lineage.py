"""Lineage: which parameters each term's value depends on, and where that dependence stops carrying
gradient.

One step of an execution path runs under a ``TorchDispatchMode`` (every aten op, the backward ops of an
``autograd.grad`` inside the step included) and a ``TorchFunctionMode`` (the Python-level call each aten
op belongs to: a user's ``.detach()`` versus autograd's own detach of a saved tensor; ``.tolist()`` and
``.numpy()``, which reach no aten op). Every tensor gets three bitmasks:

* *value*: the parameters its values depend on;
* *grad*: the parameters whose gradient can flow back through it;
* *sites*: the cut sites in its history.

A **cut site** is where value dependence goes on but gradient does not: ``detach`` / ``.data``, an op
run with grad mode off or in inference mode, an integer cast, ``autograd.grad`` without
``create_graph``, a leaf re-created from data (``torch.tensor(x.tolist())``, matched by value), a
constant frozen into a traced graph. Dependence that leaves torch as a Python number or a NumPy array
(``.item()``, ``float()``, ``.tolist()``, ``.numpy()``) cannot be followed; those sites are *leaving*
sites, confirmed per term by finite differences (``evidence.confirm``). Masks, comparisons, argmax and
index tensors are not cuts: non-floating outputs of anything but a cast carry no lineage.

A dispatch mode does not see inside compiled code, and dynamo skips (and keeps skipping) a compiled
frame under a dispatch mode. A path is therefore recorded under ``torch.compiler.set_stance("force_eager")``:
what is recorded is the eager execution of the path's Python, never the compiled measurement. FX graph
replays (a ``make_fx`` trace) are seen op by op and named by graph node, with the user's line when the
trace kept stack traces.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import inspect
import linecache
import math
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from ..frames import FX_CODE, TORCH_DIR, is_user_file, user_frame_in_stack_trace

# Kinds of cut site.
DETACH, DATA, NO_GRAD, INFERENCE = "detach", "data", "no_grad", "inference_mode"
INT_CAST, BAKED, NONFINITE, NON_DIFF = "int_cast", "baked_constant", "nonfinite", "non_differentiable"
NO_CREATE_GRAPH, UNUSED_INPUT = "autograd_grad_no_create_graph", "autograd_grad_unused_input"
# Not a cut: the call of a custom autograd.Function in a value's history, whose backward (not autograd)
# decides the gradient. Named when the gradients check finds that gradient off its finite differences.
FUNCTION = "custom_function"
ITEM, FLOAT, TOLIST, NUMPY = "item", "float", "tolist", "numpy"
LEAVING = (ITEM, FLOAT, TOLIST, NUMPY)
KINDS = (
    DETACH,
    DATA,
    NO_GRAD,
    INFERENCE,
    INT_CAST,
    BAKED,
    NONFINITE,
    NON_DIFF,
    NO_CREATE_GRAPH,
    UNUSED_INPUT,
    FUNCTION,
    *LEAVING,
)

_FX_LINE = re.compile(r"^\s*(\w+)\s*=")

# aten ops whose outputs do not depend on their inputs' values (shapes only, or fresh values).
_FRESH = frozenset(
    {
        "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
        "new_zeros", "new_ones", "new_empty", "new_full", "new_empty_strided", "empty_strided",
        "scalar_tensor", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
    }
)  # fmt: skip
_CASTS = frozenset({"_to_copy", "to", "_to_dtype", "copy", "type_as", "view_as_real"})
_LIFT = frozenset({"lift_fresh", "lift_fresh_copy"})
_PY_DETACH = {"detach": DETACH, "detach_": DETACH, "data": DATA}
_ZERO = (0, 0, 0)


@dataclass(frozen=True)
class CutSite:
    """One place where a tensor that depends on parameters stops carrying their gradient."""

    id: int
    kind: str
    op: str
    module: str | None  # innermost running module of the model ("" = the root; None: unknown, a graph node)
    module_type: str
    file: str
    line: int
    code: str
    parameters: tuple[str, ...]  # whose gradient-carrying dependence enters the site
    container: str = "python"  # python | fx (a replayed FX graph: node names it)
    node: str | None = None
    detail: str = ""
    feeds_backward: bool = False  # an FX-replay tensor from this site is used by a *_backward op
    after: tuple[int, ...] = ()  # cut sites already in the history of the value cut here (a chain)
    # The call that set this site up, where it is not the site's own line: the .eval()/.train(False)
    # that switched the module out of training before an autograd.grad without create_graph.
    root: dict[str, Any] | None = None

    @property
    def leaving(self) -> bool:
        return self.kind in LEAVING

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "parameters": list(self.parameters), "after": list(self.after)}


@dataclass
class TermLineage:
    """What one term's value depends on: parameters by value, those that carry gradient, cut sites."""

    depends_on: tuple[str, ...]
    carries: tuple[str, ...]
    sites: tuple[int, ...]

    @property
    def cut(self) -> tuple[str, ...]:
        """Parameters the value depends on without gradient: cut somewhere on the way."""
        carried = set(self.carries)
        return tuple(p for p in self.depends_on if p not in carried)

    def to_dict(self) -> dict[str, Any]:
        # ``carries`` is ``depends_on`` minus ``cut``: not written twice (large models, several paths).
        return {"depends_on": list(self.depends_on), "cut": list(self.cut), "sites": list(self.sites)}


@dataclass
class PathLineage:
    """The lineage of one path's step: per term (or ``"__total__"`` when the path returns no terms)."""

    label: str
    terms: dict[str, TermLineage] = field(default_factory=dict)
    sites: list[CutSite] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0
    ops: int = 0
    mode_calls: list[dict[str, Any]] = field(default_factory=list)  # .eval()/.train() the step called

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "terms": {t: x.to_dict() for t, x in self.terms.items()},
            "sites": [s.to_dict() for s in self.sites],
            "error": self.error,
            "seconds": self.seconds,
            "ops": self.ops,
            "mode_calls": self.mode_calls,
        }


def _walk(obj: Any) -> Iterator[Any]:
    if isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _walk(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _walk(item)
    else:
        yield obj


def tensors_in(obj: Any) -> list[Tensor]:
    return [t for t in _walk(obj) if isinstance(t, Tensor)]


def _floating(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


class _Site:
    """A cut site while it is being recorded: widened by every later pass of the same place."""

    __slots__ = ("at", "bits", "detail", "feeds_backward", "history", "id", "kind", "op", "root")

    def __init__(self, sid: int, kind: str, op: str, at: dict[str, Any], detail: str) -> None:
        self.id, self.kind, self.op, self.at, self.detail = sid, kind, op, at, detail
        self.bits = 0
        self.history = 0  # the cut sites in the history of the value cut (or that left) here
        self.feeds_backward = False
        self.root: dict[str, Any] | None = None

    def frozen(self, names_of: Callable[[int], tuple[str, ...]]) -> CutSite:
        at = self.at
        detail = self.detail
        if at.get("input_op"):  # a graph node: what it cuts (a detach of a saved tanh output, say)
            detail = (
                f"{detail}; on the output of {at['input_op']}"
                if detail
                else f"on the output of {at['input_op']}"
            )
        return CutSite(
            self.id, self.kind, self.op, at["module"], at["module_type"], at["file"], at["line"], at["code"],
            names_of(self.bits), at.get("container", "python"), at.get("node"), detail, self.feeds_backward,
            tuple(i for i in range(self.id) if self.history >> i & 1), self.root,
        )  # fmt: skip


class _Recorder:
    """The shared state of the two modes: lineage per tensor, running modules, cut sites."""

    def __init__(
        self, model: nn.Module, sources: Sequence[tuple[str, Tensor]], *, check_nonfinite: bool = False,
        map_lines: bool = False,
    ) -> None:  # fmt: skip
        self.names = [n for n, _ in sources]
        # check_nonfinite: name each op that makes NaN/Inf from finite inputs (one host sync per op).
        # map_lines: (file, line) -> (first module seen there, all parameters its ops depended on).
        self.check_nonfinite, self.map_lines = check_nonfinite, map_lines
        self.line_info: dict[tuple[str, int], tuple[str, str, int]] = {}
        # tensor -> (value bits, grad bits, site bits); by identity (a tensor's __eq__ is elementwise)
        self.lin: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.frozen = 0  # sources that can never receive a gradient (requires_grad=False)
        for i, (_, t) in enumerate(sources):
            # A frozen source carries its values on, but no gradient can reach it.
            self.lin[t] = (1 << i, (1 << i) if t.requires_grad else 0, 0)
            self.frozen |= 0 if t.requires_grad else 1 << i
        self.module_names = {m: n for n, m in model.named_modules()}
        self.stack: list[nn.Module] = []
        self.python_cut: list[str | None] = []  # the Python-level call in progress asks for a cut
        self.python_op: list[str] = []
        self.grad_calls: list[tuple[bool, nn.Module | None]] = []  # autograd.grad calls in progress
        self.sites: list[_Site] = []
        self.by_place: dict[tuple[Any, ...], _Site] = {}
        self.leaving: list[tuple[_Site, Any]] = []  # value that left torch: float, or a CPU copy
        self.made_by_function: WeakIdKeyDictionary = WeakIdKeyDictionary()  # -> ((file, line), name)
        self.ops = 0
        self.node_cache: dict[int, dict[str, torch.fx.Node]] = {}
        self.mode_calls: list[dict[str, Any]] = []  # module.train(False)/eval() the step called, in order

    # ----- where ---------------------------------------------------------------------------------

    def where(self, grad_off: bool = False) -> dict[str, Any]:
        """Innermost model module and user frame; for an FX replay the graph node (and its user line).

        ``grad_off``: the cut is an op run with grad mode off; the place to name is the line inside
        the ``with torch.no_grad()`` / ``inference_mode()`` block (or the decorated function) that
        the user wrote, which may be a caller of the frame where the op ran (the model's own code).
        """
        mod = self.stack[-1] if self.stack else None
        module, mtype = (self.module_names[mod], type(mod).__name__) if mod is not None else ("", "")
        frame = sys._getframe(1)
        while frame is not None and not is_user_file(frame.f_code.co_filename):
            frame = frame.f_back
        if frame is None:
            return {"module": module, "module_type": mtype, "file": "", "line": 0, "code": ""}
        file, line = frame.f_code.co_filename, frame.f_lineno
        if file.startswith(FX_CODE):
            return self._fx_where(frame, module, mtype)
        if grad_off:
            opened = _grad_off_frame(frame)
            if opened is not None and opened is not frame:
                ran = f"the op ran in {module or 'the root module'} at {os.path.basename(file)}:{line}"
                file, line = opened.f_code.co_filename, opened.f_lineno
                return {"module": "", "module_type": "", "file": file, "line": line,
                        "code": linecache.getline(file, line).strip(), "ran": ran}  # fmt: skip
        code = linecache.getline(file, line).strip()
        return {"module": module, "module_type": mtype, "file": file, "line": line, "code": code}

    def _fx_where(self, frame: Any, module: str, mtype: str) -> dict[str, Any]:
        code = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        match = _FX_LINE.match(code)
        node_name = match.group(1) if match else None
        gm = frame.f_locals.get("self")
        node = None
        if node_name is not None and isinstance(gm, torch.fx.GraphModule):
            nodes = self.node_cache.get(id(gm))
            if nodes is None:
                nodes = self.node_cache[id(gm)] = {n.name: n for n in gm.graph.nodes}
            node = nodes.get(node_name)
        # The running module says nothing about a graph node (the whole graph runs inside one call):
        # the node's own module stack, when the trace recorded one, does.
        out: dict[str, Any] = {
            "module": None, "module_type": "", "file": "", "line": 0, "code": code.strip(),
            "container": "fx", "node": node_name,
        }  # fmt: skip
        if node is not None:
            user = user_frame_in_stack_trace(node.meta.get("stack_trace"))
            if user is not None:
                out.update(file=user["file"], line=user["line"], code=user["code"])
            producer = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
            if producer is not None and producer.op == "call_function":
                out["input_op"] = f"{getattr(producer.target, '__name__', producer.target)} ({producer.name})"
            stack = node.meta.get("nn_module_stack") or {}
            if stack:
                path, cls = list(stack.values())[-1]
                out["module"] = str(path)
                out["module_type"] = getattr(cls, "__name__", str(cls).rsplit(".", 1)[-1].strip("'>"))
        return out

    # ----- bookkeeping ---------------------------------------------------------------------------

    def of(self, tensors: Iterable[Tensor]) -> tuple[int, int, int]:
        v = g = s = 0
        for t in tensors:
            a, b, c = self.lin.get(t, _ZERO)
            v, g, s = v | a, g | b, s | c
        return v, g, s

    def site(
        self,
        kind: str,
        op: str,
        bits: int,
        detail: str = "",
        value: int = 0,
        at: tuple[str, int] | None = None,
        history: int = 0,
    ) -> _Site:
        """The cut site at the current place, or at ``at`` = (file, line) (created, or widened by
        ``bits``, plus the frozen sources among ``value``: they can never carry gradient, but the values
        cut there depend on them). ``history``: the sites already in the history of the value cut here
        (the earlier links of a chain of cuts)."""
        bits |= value & self.frozen
        if at is None:
            at = self.where(grad_off=kind in (NO_GRAD, INFERENCE))
        else:
            file, line = at
            at = {
                "module": "",
                "module_type": "",
                "file": file,
                "line": line,
                "code": linecache.getline(file, line).strip(),
            }
        if at.get("ran"):
            detail = f"{detail}; {at['ran']}" if detail else at["ran"]
        key = (kind, at["file"], at["line"], at.get("node"))
        site = self.by_place.get(key)
        if site is None:
            site = self.by_place[key] = _Site(len(self.sites), kind, op, at, detail)
            self.sites.append(site)
        site.bits |= bits
        site.history |= history & ~(1 << site.id)
        return site

    def names_of(self, bits: int) -> tuple[str, ...]:
        return tuple(n for i, n in enumerate(self.names) if bits >> i & 1)

    def lineage_of(self, value: Any) -> TermLineage:
        v, g, s = self.of([value]) if isinstance(value, Tensor) else _ZERO
        return TermLineage(
            self.names_of(v), self.names_of(g), tuple(x.id for x in self.sites if s >> x.id & 1)
        )

    def cut_sites(self) -> list[CutSite]:
        return [x.frozen(self.names_of) for x in self.sites]

    def mode_call(self, module: nn.Module, mode: bool) -> None:
        """``module.train(mode)`` (or ``.eval()``) called while the step runs: which module, where."""
        if module not in self.module_names:
            return
        frame = sys._getframe(2)
        while frame is not None and not is_user_file(frame.f_code.co_filename):
            frame = frame.f_back
        if frame is None:
            return
        file, line = frame.f_code.co_filename, frame.f_lineno
        self.mode_calls.append({"module": self.module_names[module], "mode": "train" if mode else "eval",
                                "file": file, "line": line, "code": linecache.getline(file, line).strip()})  # fmt: skip

    def eval_call_over(self, module: nn.Module | None) -> dict[str, Any] | None:
        """The last ``.eval()`` the step called on ``module`` or a module holding it, if any."""
        name = self.module_names.get(module) if module is not None else None
        if name is None:
            return None
        for call in reversed(self.mode_calls):
            owner = call["module"]
            if owner == "" or name == owner or name.startswith(owner + "."):
                return call if call["mode"] == "eval" else None
        return None

    def enter(self, module: nn.Module, args: Any) -> None:
        if module in self.module_names:
            self.stack.append(module)

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if any(m is module for m in self.stack):  # pops through it, so an exception cannot skew the stack
            while self.stack.pop() is not module:
                pass


class _Ops(TorchDispatchMode):
    """Propagates lineage through every aten op and records where gradient stops."""

    def __init__(self, rec: _Recorder) -> None:
        super().__init__()
        self.rec = rec
        self._func_name: Any = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        rec = self.rec
        kwargs = kwargs or {}
        rec.ops += 1
        self._func_name = func
        name = func.overloadpacket.__name__
        flat = list(_walk((args, kwargs)))
        ins = [t for t in flat if isinstance(t, Tensor)]
        v, g, s = rec.of(ins)
        if rec.leaving and name not in _FRESH:
            v, s = self._python_numbers(flat, v, s)
        grad_on = torch.is_grad_enabled()
        inference = torch.is_inference_mode_enabled()
        out = func(*args, **kwargs)
        if rec.map_lines:
            at = rec.where()
            first, ftype, bits = rec.line_info.get(
                (at["file"], at["line"]), (at["module"], at["module_type"], 0)
            )
            rec.line_info[at["file"], at["line"]] = (first, ftype, bits | v)
        if rec.check_nonfinite and v:
            self._nonfinite(out, ins, flat, v)
        if name == "_local_scalar_dense":
            if v:
                kind = FLOAT if rec.python_op and rec.python_op[-1] == "Tensor.__float__" else ITEM
                site = rec.site(
                    kind, _python_name(rec, func), g or v, "leaves torch as a Python number", v, history=s
                )
                rec.leaving.append((site, out))
            return out
        if name in _LIFT:
            self._lifted(out, name)
            return out
        if name in _FRESH or not (v or s):
            return out
        if name == "mul" and self._times_zero(flat, ins):
            return out  # x * 0 depends on nothing (a switched-off term's weight, a find_* flag of 0)
        if name.endswith("_backward") and s:
            for site in rec.sites:
                if s >> site.id & 1 and site.at.get("container") == "fx" and site.kind in (DETACH, DATA):
                    site.feeds_backward = True
        kind = None
        if name == "detach":
            kind = rec.python_cut[-1] if rec.python_cut else None
            if kind is not None:
                rec.python_cut[-1] = None  # consumed: autograd's own detaches inside it stay aliases
        elif g and (not grad_on or inference):
            # A custom autograd.Function's forward always runs with grad off: its backward decides, and
            # autograd tells afterwards whether its outputs carry gradient (``_autograd_disagrees``).
            caller = _custom_function_caller()
            if caller is None:
                kind = self._no_grad_kind(inference)
            else:
                place = (caller.f_code.co_filename, caller.f_lineno)
                fname = _function_name(caller)
                function = rec.site(
                    FUNCTION, fname, g, "its backward gives the gradient", v, at=place, history=s
                )
                s |= 1 << function.id
                for t in tensors_in(out):
                    rec.made_by_function[t] = (place, fname)
        op = "torch.autograd.grad" if kind == NO_CREATE_GRAPH else _python_name(rec, func)
        written = [
            a for a, arg in zip(args, func._schema.arguments, strict=False)
            if isinstance(a, Tensor) and arg.alias_info is not None and arg.alias_info.is_write
        ]  # fmt: skip
        for t in written:
            # Written in place: it now holds values of every input; gradient still reaches it as it
            # did (a leaf clamped under no_grad still gets its gradient), plus the inputs' when grad is on.
            own = rec.lin.get(t, _ZERO)
            if kind is not None and g & ~own[1]:
                site = self._cut(kind, op, g & ~own[1], v, s)
                rec.lin[t] = (v, own[1], s | (1 << site.id))
            else:
                rec.lin[t] = (v, own[1] if kind is not None else g, s)
            if t._base is not None:
                # A write into a view (``buf[i] = x``, ``buf[i].copy_(x)``) is a write into its base too,
                # which later reads of the whole buffer see: the base keeps its own and gains the view's.
                bv, bg, bs = rec.lin.get(t._base, _ZERO)
                nv, ng, ns = rec.lin[t]
                rec.lin[t._base] = (bv | nv, bg | ng, bs | ns)
        float_in = [t for t in ins if _floating(t)]
        for t in tensors_in(out):
            if any(t is w for w in written):
                continue
            if _floating(t):
                if kind is not None and g:
                    site = self._cut(kind, op, g, v, s)
                    rec.lin[t] = (v, 0, s | (1 << site.id))
                else:
                    rec.lin[t] = (v, 0 if kind is not None else g, s)
            elif name in _CASTS and float_in:
                fv, fg, fs = rec.of(float_in)
                if fg:
                    site = rec.site(
                        INT_CAST, _python_name(rec, func), fg, f"cast to {t.dtype}", fv, history=fs
                    )
                    rec.lin[t] = (v, 0, s | (1 << site.id))
                elif fv:
                    rec.lin[t] = (v, 0, s)
            else:
                # Comparisons, argmax, indices: not a cut. Only integer lineage (from a cast) flows on.
                iv, _, i_s = rec.of(x for x in ins if not _floating(x))
                if iv:
                    rec.lin[t] = (iv, 0, i_s)
        return out

    def _nonfinite(self, out: Any, ins: list[Tensor], flat: list[Any], v: int) -> None:
        # A deliberate inf/NaN argument (masked_fill(mask, -inf)) is not an accident to report.
        if any(isinstance(x, float) and not math.isfinite(x) for x in flat):
            return
        floats = [t for t in tensors_in(out) if _floating(t)]
        if floats and not _all_finite(floats) and _all_finite(ins):
            op = self._func_name
            detail = "NaN/Inf made from finite inputs" + (f" ({op})" if self.rec.python_op else "")
            self.rec.site(NONFINITE, _python_name(self.rec, op), v, detail)

    def _times_zero(self, flat: list[Any], ins: list[Tensor]) -> bool:
        """An operand is an exact scalar zero with no lineage of its own (one host sync per such scalar)."""
        if any(type(x) in (int, float) and x == 0 for x in flat):
            return True
        for t in ins:
            if t.numel() == 1 and _floating(t) and self.rec.lin.get(t, _ZERO)[0] == 0:
                try:
                    if bool(t.detach().reshape(()) == 0):
                        return True
                except RuntimeError:  # meta / fake tensors: cannot tell
                    return False
        return False

    def _no_grad_kind(self, inference: bool) -> str:
        rec = self.rec
        if rec.grad_calls and not rec.grad_calls[-1][0]:
            return NO_CREATE_GRAPH
        return INFERENCE if inference else NO_GRAD

    def _cut(self, kind: str, op: str, bits: int, value: int, history: int) -> _Site:
        site = self.rec.site(kind, op, bits, self._detail(kind), value, history=history)
        if kind == NO_CREATE_GRAPH and site.root is None and self.rec.grad_calls:
            site.root = self.rec.eval_call_over(self.rec.grad_calls[-1][1])
        return site

    def _detail(self, kind: str) -> str:
        if kind != NO_CREATE_GRAPH:
            return ""
        module = self.rec.grad_calls[-1][1]
        eval_mode = module is not None and not module.training
        return "create_graph=False" + (
            " while the module is in eval mode (self.training=False)" if eval_mode else ""
        )

    def _python_numbers(self, flat: list[Any], v: int, s: int) -> tuple[int, int]:
        """A Python number from ``.item()`` / ``float()`` passed to an op: connected by its value."""
        for x in flat:
            if type(x) is float:
                for site, value in self.rec.leaving:
                    if type(value) is float and value == x:
                        s |= (1 << site.id) | site.history  # the cuts before it come back with the number
                        v |= site.bits
        return v, s

    def _lifted(self, out: Any, name: str) -> None:
        """A tensor made from Python data: a constant frozen into an FX graph, or a re-created leaf
        whose values match a tensor that left torch (``torch.tensor(x.tolist())``)."""
        rec = self.rec
        if rec.where().get("container") == "fx":
            site = rec.site(BAKED, name, 0, "a value frozen into the traced graph at trace time")
            for t in tensors_in(out):
                rec.lin[t] = (0, 0, 1 << site.id)
            return
        for t in tensors_in(out):
            for left, value in rec.leaving:
                if isinstance(value, Tensor) and _same_values(t, value):
                    rec.lin[t] = (left.bits, 0, left.history | (1 << left.id))
                    break


def _all_finite(tensors: Iterable[Tensor]) -> bool:
    try:
        return all(bool(torch.isfinite(t).all()) for t in tensors if _floating(t))
    except (RuntimeError, NotImplementedError):  # meta, sparse, ... tensors: cannot tell, assume finite
        return True


_GRAD_OFF = ("no_grad", "inference_mode", "set_grad_enabled(False)", "enable_grad(False)")
_FUNCTION_FILE = os.path.join(TORCH_DIR, "autograd", "function.py")


def _function_name(caller: Any) -> str:
    """``Softplus.apply`` for the custom Function whose forward is running (called from ``caller``)."""
    frame = sys._getframe(2)
    found = "torch.autograd.Function.apply"
    # The outermost ``forward`` below the caller: inner ones are modules the Function's forward runs
    # (a checkpointed block's layers).
    while frame is not None and frame is not caller:
        qualname = frame.f_code.co_qualname
        if frame.f_code.co_name == "forward" and "." in qualname:
            found = qualname.rsplit(".", 1)[0] + ".apply"
        frame = frame.f_back
    return found


def _custom_function_caller() -> Any:
    """Inside the forward of a custom ``torch.autograd.Function``: the frame that called its ``apply``
    (None outside one)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "apply" and frame.f_code.co_filename == _FUNCTION_FILE:
            caller = frame.f_back  # the user's line that called it (through torch's own wrappers)
            while caller is not None and not is_user_file(caller.f_code.co_filename):
                caller = caller.f_back
            return caller or frame
        frame = frame.f_back
    return None


@functools.cache
def _grad_off_spans(file: str) -> tuple[tuple[int, int], ...]:
    """Line spans of ``with torch.no_grad():``-like blocks and of functions decorated so, in a file."""
    try:
        tree = ast.parse("".join(linecache.getlines(file)))
    except (SyntaxError, ValueError):
        return ()
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.With, ast.AsyncWith)):
            heads = [ast.unparse(item.context_expr) for item in node.items]
            body = node.body
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            heads = [ast.unparse(d) for d in node.decorator_list]
            body = node.body
        else:
            continue
        if body and any(any(k in h for k in _GRAD_OFF) for h in heads):
            spans.append((body[0].lineno, max(getattr(b, "end_lineno", b.lineno) or b.lineno for b in body)))
    return tuple(spans)


def _grad_off_frame(frame: Any) -> Any:
    """The innermost user frame whose current line lies inside a block that turns grad mode off."""
    while frame is not None:
        file = frame.f_code.co_filename
        user = is_user_file(file) and not file.startswith(FX_CODE)
        if user and any(a <= frame.f_lineno <= b for a, b in _grad_off_spans(file)):
            return frame
        frame = frame.f_back
    return None


def _same_values(t: Tensor, value: Tensor) -> bool:
    if t.numel() != value.numel() or t.numel() == 0:
        return False
    try:
        return bool(torch.equal(t.detach().reshape(-1).to("cpu", value.dtype), value.reshape(-1)))
    except (RuntimeError, TypeError):
        return False


def _python_name(rec: _Recorder, func: Any) -> str:
    """The op as the user wrote it when a Python-level call is in progress, else the aten op."""
    return rec.python_op[-1] if rec.python_op else str(func)


class _Calls(TorchFunctionMode):
    """The Python-level call each aten op belongs to; ``.tolist()``/``.numpy()``; ``autograd.grad``."""

    def __init__(self, rec: _Recorder) -> None:
        super().__init__()
        self.rec = rec
        self.grad_sig = inspect.signature(torch.autograd.grad)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        rec = self.rec
        if func is torch.autograd.grad:
            return self._grad(args, kwargs)
        op = _op_name(func)
        base = op.rsplit(".", 1)[-1]
        grad_on = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        if grad_on:
            self._autograd_disagrees(tensors_in((args, kwargs)), op, "an input")
        cut = _PY_DETACH.get(base) if op.startswith("torch.Tensor.") else None
        if op == "aten.detach.default":  # a replayed FX graph's detach node
            cut = DETACH
        rec.python_cut.append(cut)
        rec.python_op.append(op.removeprefix("torch.") if op.startswith("torch.Tensor.") else op)
        try:
            out = func(*args, **kwargs)
        finally:
            rec.python_cut.pop()
            rec.python_op.pop()
        if (
            base in (TOLIST, NUMPY)
            and op.startswith("torch.Tensor.")
            and args
            and isinstance(args[0], Tensor)
        ):
            v, g, s = rec.of(args[:1])
            if v:
                what = "a Python list" if base == TOLIST else "a NumPy array"
                # The cut sites before it (x.detach().numpy()) come back with the data.
                site = rec.site(base, op.removeprefix("torch."), g or v, f"leaves torch as {what}", history=s)
                src = args[0].detach()
                rec.leaving.append((site, src.to("cpu").clone() if src.numel() <= 1 << 20 else src[:0]))
        elif grad_on:
            self._autograd_disagrees(tensors_in(out), op, "its output")
        return out

    def _autograd_disagrees(self, tensors: list[Tensor], op: str, what: str) -> None:
        """Tensors the aten ops say carry gradient but autograd does not: a cut the dispatch level cannot
        see (``x.new_tensor(t)``, ``torch.tensor(t)``, a custom Function's non-differentiable output, an
        op without a derivative, a C++ extension without autograd). Checked on the outputs of every
        Python-level call, and on its inputs (a custom Function's outputs reach no such call first)."""
        rec = self.rec
        for t in tensors:
            if _floating(t) and not t.requires_grad:
                v, g, s = rec.lin.get(t, _ZERO)
                if g:
                    name = op.removeprefix("torch.") if op.startswith("torch.Tensor.") else op
                    made, fname = rec.made_by_function.get(t, (None, None))
                    if made is not None:  # name the custom Function's call, not where its output is used
                        name, what = fname, f"the output of {fname} (a custom autograd.Function)"
                    site = rec.site(NON_DIFF, name, g, f"{what} does not require grad", v, at=made, history=s)
                    rec.lin[t] = (v, 0, s | (1 << site.id))

    def _grad(self, args: Any, kwargs: Any) -> Any:
        rec = self.rec
        bound = self.grad_sig.bind(*args, **kwargs)
        outputs = tensors_in(bound.arguments.get("outputs"))
        inputs = tensors_in(bound.arguments.get("inputs"))
        create_graph = bool(bound.arguments.get("create_graph", False))
        rec.grad_calls.append((create_graph, rec.stack[-1] if rec.stack else None))
        rec.python_op.append("torch.autograd.grad")  # the backward's ops belong to this call
        _, g, _ = rec.of(outputs)
        try:
            result = torch.autograd.grad(*args, **kwargs)
        except RuntimeError as err:
            if g and "appears to not have been used in the graph" in str(err):
                rec.site(
                    UNUSED_INPUT,
                    "torch.autograd.grad",
                    g,
                    "an input is not used by the differentiated outputs",
                )
            raise
        finally:
            rec.grad_calls.pop()
            rec.python_op.pop()
        if g and inputs and any(r is None for r in _walk(result)):
            rec.site(
                UNUSED_INPUT,
                "torch.autograd.grad",
                g,
                "a gradient is None: the outputs do not use that input",
            )
        elif g and inputs and bound.arguments.get("materialize_grads") and _unused(outputs, inputs):
            rec.site(
                UNUSED_INPUT,
                "torch.autograd.grad",
                g,
                "an input the outputs do not use: its gradient comes back as zeros (materialize_grads=True)",
            )
        return result


def _unused(outputs: Sequence[Tensor], inputs: Sequence[Tensor]) -> bool:
    """Some input is not in the outputs' autograd graph (found by walking it, not by a backward)."""
    wanted = {id(t.grad_fn) if t.grad_fn is not None else id(t) for t in inputs}
    seen: set[int] = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack and wanted:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        wanted.discard(id(node))
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: the leaf it feeds
        if variable is not None:
            wanted.discard(id(variable))
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return bool(wanted)


def _op_name(func: Callable[..., Any]) -> str:
    name = resolve_name(func) or getattr(func, "__qualname__", None) or repr(func)
    return name.removesuffix(".__get__")  # property getters such as Tensor.data


def force_eager() -> contextlib.AbstractContextManager[Any]:
    """``torch.compiler.set_stance("force_eager")`` (torch 2.6+); on older torch a dispatch mode makes
    dynamo run compiled frames eagerly anyway (and skip them until ``torch._dynamo.reset()``)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


@contextlib.contextmanager
def recording(
    model: nn.Module, sources: Sequence[tuple[str, Tensor]], *, check_nonfinite: bool = False,
    map_lines: bool = False,
) -> Iterator[_Recorder]:  # fmt: skip
    """The recorder, active for the body; everything it installed is removed on exit, also on error.
    ``recorder.lineage_of(tensor)`` and ``recorder.cut_sites()`` read what it saw."""
    rec = _Recorder(model, sources, check_nonfinite=check_nonfinite, map_lines=map_lines)
    with _instrumented(rec):
        yield rec


@contextlib.contextmanager
def _instrumented(rec: _Recorder) -> Iterator[None]:
    with contextlib.ExitStack() as undo:  # every step is undone, in reverse, whatever happens
        undo.callback(register_module_forward_pre_hook(rec.enter).remove)
        undo.callback(register_module_forward_hook(rec.leave, always_call=True).remove)
        # force_eager: compiled functions inside the path run their Python, and dynamo leaves no
        # skip mark on them (a dispatch mode alone would make dynamo skip them until reset()).
        undo.enter_context(force_eager())
        # A compiled module called under our global hooks warns that they fire twice: harmless here
        # (the hooks only track which module runs), and not the user's concern.
        undo.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message=".*global hooks on modules.*")
        undo.enter_context(_Calls(rec))
        undo.enter_context(_Ops(rec))
        # Which line of the step switches a module's mode (the root of an eval-mode cut): Module.train
        # is wrapped for the recording (eval() calls it), and put back.
        original = nn.Module.train

        def train(module: nn.Module, mode: bool = True) -> nn.Module:
            rec.mode_call(module, bool(mode))
            return original(module, mode)

        nn.Module.train = train  # type: ignore[method-assign]
        undo.callback(setattr, nn.Module, "train", original)
        yield


def merged(parts: Mapping[str, PathLineage], label: str) -> PathLineage:
    """One lineage from several recordings of the same path (one per term, for a path that returns
    only its total): each term's lineage from its own recording, cut sites merged by place."""
    out = PathLineage(label)
    ids: dict[tuple[Any, ...], int] = {}
    sites: list[CutSite] = []
    for term, part in parts.items():
        remap = {}
        for site in part.sites:
            key = (site.kind, site.file, site.line, site.node)
            after = tuple(remap[i] for i in site.after if i in remap)  # earlier sites: remapped already
            if key not in ids:
                ids[key] = len(sites)
                sites.append(dataclasses.replace(site, id=len(sites), after=after))
            else:
                old = sites[ids[key]]
                wider = tuple(dict.fromkeys(old.parameters + site.parameters))
                sites[ids[key]] = dataclasses.replace(
                    old, parameters=wider, feeds_backward=old.feeds_backward or site.feeds_backward
                )
            remap[site.id] = ids[key]
        if part.error is not None and out.error is None:
            out.error = part.error
        for t, tl in part.terms.items():
            out.terms[term if t == "__total__" else t] = TermLineage(
                tl.depends_on, tl.carries, tuple(remap[i] for i in tl.sites)
            )
        out.seconds += part.seconds
        out.ops += part.ops
        out.mode_calls += part.mode_calls
    out.sites = sites
    return out


def record(
    model: nn.Module,
    sources: Sequence[tuple[str, Tensor]],
    call: Callable[[], Any],
    label: str,
    terms_of: Callable[[Any], Mapping[str, Tensor]],
) -> PathLineage:
    """Run ``call()`` once under the recorder; ``terms_of(result)`` picks the term tensors.

    ``sources`` are the tensors whose influence is traced (the trainable parameters, by name). The
    recorder never raises for the path: an exception is returned as ``error`` with what was seen.
    """
    rec = _Recorder(model, sources)
    start = time.perf_counter()
    out = PathLineage(label)
    try:
        with _instrumented(rec):
            result = call()
        for term, value in terms_of(result).items():
            out.terms[term] = rec.lineage_of(value)
    except Exception as e:  # the measurement stands without lineage: a recorded failure
        text = str(e).strip()
        out.error = f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"
    out.sites = rec.cut_sites()
    out.seconds = time.perf_counter() - start
    out.ops = rec.ops
    out.mode_calls = rec.mode_calls
    return out
