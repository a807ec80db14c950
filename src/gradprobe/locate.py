"""Where a gradient chain breaks: the module, op and source line that cut a term off some parameters.

``locate_breaks`` runs the step once under a ``TorchFunctionMode`` that tracks which parameters each
tensor depends on (a bitmask over ``model.named_parameters()``) and records each op whose inputs carry
parameter gradients but whose output does not. ``locate_nonfinite_backward`` finds the forward line
whose backward makes NaN; ``module_reach``/``frontier`` bracket a break between module outputs. All
that is installed is removed in ``finally``; modes, grad mode and ``.grad`` are never touched.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import linecache
import math
import operator
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils.weak import WeakIdKeyDictionary

KINDS = ("detach", "no_grad", "item", "numpy", "tolist", "int_cast", "nonfinite")
KINDS += ("autograd_grad_no_create_graph", "autograd_grad_unused_input")

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_ZOO_DIR = os.path.join(_OWN_DIR, "zoo") + os.sep
_NON_TENSOR = {"item": "item", "__float__": "item", "__int__": "item", "__complex__": "item"}
_NON_TENSOR |= {"tolist": "tolist", "numpy": "numpy"}
_DETACH = {"detach", "detach_", "data"}
_SHAPE_ONLY = {"expand_as", "view_as", "reshape_as"}
_CASTS = {"long", "int", "short", "char", "byte", "bool", "to", "type", "type_as"}
# Outputs that do not depend on the inputs' values: no provenance, and not a break.
_FRESH = {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like"}
_FRESH |= {"new_zeros", "new_ones", "new_empty", "new_full", "new_tensor", "grad", "_base"}
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')
_NAN_NODE = re.compile(r"Function '(?P<node>\w+)' returned nan")


@dataclass(frozen=True)
class Break:
    """One place where a tensor that depends on parameters stops carrying their gradient."""

    kind: str
    op: str
    module: str  # innermost running module of the model ("" = the root; module_type "" = no forward)
    module_type: str
    file: str
    line: int
    code: str
    parameters: tuple[str, ...]
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data."""
        return {**asdict(self), "parameters": list(self.parameters)}


@functools.cache
def _is_user_file(path: str) -> bool:
    """User code: outside torch and gradprobe, except the zoo (reference models written like user code)."""
    path = os.path.abspath(path)
    return path.startswith(_ZOO_DIR) or not path.startswith((_TORCH_DIR, _OWN_DIR))


def _walk(obj: Any) -> Iterator[Any]:
    """Leaves of nested lists, tuples and dicts (how torch functions take and return tensors)."""
    if not isinstance(obj, (list, tuple, dict)):
        yield obj
        return
    for item in obj.values() if isinstance(obj, dict) else obj:
        yield from _walk(item)


def _tensors(obj: Any) -> list[Tensor]:
    return [t for t in _walk(obj) if isinstance(t, Tensor)]


def _is_float(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _all_finite(tensors: Iterable[Tensor]) -> bool:
    try:
        return all(bool(torch.isfinite(t).all()) for t in tensors if _is_float(t))
    except (RuntimeError, NotImplementedError):  # meta, sparse, ... tensors: cannot tell, assume finite
        return True


def _op_name(func: Callable[..., Any]) -> str:
    name = resolve_name(func) or getattr(func, "__qualname__", None) or repr(func)
    name = name.removesuffix(".__get__")  # property getters such as Tensor.data
    return name.removeprefix("torch.") if name.startswith("torch.Tensor.") else name


class _Tracker(TorchFunctionMode):
    """Parameter provenance of every tensor made while active, the running modules, and the breaks."""

    def __init__(self, model: nn.Module, *, check_nonfinite: bool = False, map_lines: bool = False) -> None:
        super().__init__()
        self.model = model
        params = dict(model.named_parameters())
        self.names, self.param_ids = list(params), {id(p) for p in params.values()}
        # tensor -> bitmask; by identity, as tensors' __eq__ is elementwise (no WeakKeyDictionary)
        self.deps = WeakIdKeyDictionary({p: 1 << i for i, p in enumerate(params.values())})
        self.module_names = {m: n for n, m in model.named_modules()}
        self.stack: list[nn.Module] = []
        self.check_nonfinite, self.map_lines = check_nonfinite, map_lines
        self.found: dict[tuple[str, str, int], tuple[Break, int]] = {}
        self.line_info: dict[tuple[str, int], tuple[str, str, int]] = {}
        self.orig_grad, self.in_grad = torch.autograd.grad, False
        self.grad_sig = inspect.signature(self.orig_grad)

    def enter(self, module: nn.Module, args: Any) -> None:
        if module in self.module_names:
            self.stack.append(module)

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if any(m is module for m in self.stack):  # pops through it, so an exception cannot skew the stack
            while self.stack.pop() is not module:
                pass

    def where(self) -> tuple[str, str, str, int, str]:
        """Innermost running model module and innermost user frame: (module, type, file, line, code)."""
        mod = self.stack[-1] if self.stack else None
        name, mtype = (self.module_names[mod], type(mod).__name__) if mod is not None else ("", "")
        frame = sys._getframe(1)
        while frame is not None and not _is_user_file(frame.f_code.co_filename):
            frame = frame.f_back
        file, line = (frame.f_code.co_filename, frame.f_lineno) if frame else ("", 0)
        return name, mtype, file, line, linecache.getline(file, line).strip()

    def mask(self, tensors: Iterable[Tensor]) -> int:
        return functools.reduce(operator.or_, (self.deps.get(t, 0) for t in tensors), 0)

    def names_of(self, bits: int) -> tuple[str, ...]:
        return tuple(n for i, n in enumerate(self.names) if bits >> i & 1)

    def record(self, kind: str, op: str, bits: int, detail: str = "") -> None:
        module, mtype, file, line, code = self.where()
        old, old_bits = self.found.get((kind, file, line), (None, 0))
        bits |= old_bits  # the same line again (a loop, a shared module) widens its parameter set
        brk = old or Break(kind, op, module, mtype, file, line, code, (), detail)
        self.found[kind, file, line] = (replace(brk, parameters=self.names_of(bits)), bits)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # autograd.grad dispatches here under its public name (the patch). From the patch only the real
        # one runs; called directly (`from torch.autograd import grad`) it gets the bookkeeping too.
        if func is self.orig_grad or func == self.grad:
            return (self.orig_grad if self.in_grad else self.grad)(*args, **kwargs)
        op = _op_name(func)
        base = op.rsplit(".", 1)[-1]
        # In expand_as/view_as/reshape_as the second tensor only lends its shape: no dependency flows.
        inputs = _tensors(args[:1] if base in _SHAPE_ONLY else (args, kwargs))
        deps = self.mask(inputs)
        # Read before the call: an in-place op (detach_, requires_grad_) changes requires_grad.
        live = self.mask(t for t in inputs if t.requires_grad)
        grad_on = torch.is_grad_enabled()
        out = func(*args, **kwargs)  # the mode is popped while inside its handler: no recursion
        if self.map_lines:  # for locate_nonfinite_backward: the module that ran each line, and on what
            module, mtype, file, line, _ = self.where()
            first, ftype, bits = self.line_info.get((file, line), (module, mtype, 0))
            self.line_info[file, line] = (first, ftype, bits | deps)  # first module, all its ops' params
        if base in _FRESH or not deps:
            return out
        outs = _tensors(tuple(out) if base == "__iter__" else out)
        if base == "__iter__":  # a tensor's rows, materialised so that they can be tracked
            out = iter(outs)
        if base.endswith("_") or base == "__setitem__":  # in-place: the mutated tensor takes the deps
            outs += _tensors(args[:1])
        for t in outs:
            self.deps[t] = self.deps.get(t, 0) | deps
        kind = _break_kind(base, outs, grad_on) if live else None
        if kind:
            self.record(kind, op, live)
        elif base == "numpy":  # chain already cut (x.detach().numpy()): still say where it leaves torch
            self.record("numpy", op, deps)
        if self.check_nonfinite:
            # A deliberate inf/NaN argument (masked_fill(mask, -inf)) is not an accident to report.
            deliberate = any(isinstance(x, float) and not math.isfinite(x) for x in _walk((args, kwargs)))
            floats = [t for t in outs if _is_float(t)]
            if floats and not deliberate and not _all_finite(floats) and _all_finite(inputs):
                self.record("nonfinite", op, deps, "NaN/Inf made from finite inputs")
        return out

    def grad(self, outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """Stands in for ``torch.autograd.grad``, which a TorchFunctionMode cannot see through."""
        bound = self.grad_sig.bind(outputs, inputs, *args, **kwargs)
        outs, ins = _tensors(outputs), _tensors(inputs)
        deps = self.mask(outs)
        # grad(loss, params) is the end of a chain (the training gradient itself), not a break in one.
        watch = bool(deps) and not (ins and all(id(t) in self.param_ids for t in ins))
        op, unused = "torch.autograd.grad", "autograd_grad_unused_input"
        self.in_grad, was_in = True, self.in_grad
        try:
            result = self.orig_grad(outputs, inputs, *args, **kwargs)
        except RuntimeError as err:
            if watch and "appears to not have been used in the graph" in str(err):
                self.record(unused, op, deps, "an input is not used by the differentiated outputs")
            raise
        finally:
            self.in_grad = was_in
        if watch and not bound.arguments.get("create_graph", False):
            mod = self.stack[-1] if self.stack else self.model
            why = " while the module is in eval mode (self.training=False)" if not mod.training else ""
            self.record("autograd_grad_no_create_graph", op, deps, f"create_graph=False{why}")
        if watch and any(g is None for g in (result.values() if isinstance(result, dict) else result)):
            self.record(unused, op, deps, "a gradient is None: the outputs do not use that input")
        if self.check_nonfinite and not _all_finite(_tensors(result)) and _all_finite(outs):
            self.record("nonfinite", op, deps, "NaN/Inf in the gradient of finite outputs")
        for g in _tensors(result):  # the force depends on the energy's parameters
            self.deps[g] = deps | self.mask(ins)
        return result


def _break_kind(base: str, outs: list[Tensor], grad_on: bool) -> str | None:
    """Kind of break for an op that had gradient-carrying inputs, or None if the chain goes on."""
    if base in _NON_TENSOR:
        return _NON_TENSOR[base]
    if not outs or any(t.requires_grad for t in outs):
        return None
    floating = any(_is_float(t) for t in outs)
    if base not in _DETACH and not grad_on and (floating or base in _CASTS):
        return "no_grad"
    # Comparisons, argmax and indices are not differentiable by nature; an integer cast is a choice.
    return "detach" if floating or base in _DETACH else "int_cast" if base in _CASTS else None


@contextlib.contextmanager
def _instrumented(tracker: _Tracker) -> Iterator[None]:
    with contextlib.ExitStack() as undo:  # every step is undone, in reverse, whatever happens
        undo.callback(register_module_forward_pre_hook(tracker.enter).remove)
        undo.callback(register_module_forward_hook(tracker.leave, always_call=True).remove)
        undo.callback(setattr, torch.autograd, "grad", tracker.orig_grad)
        torch.autograd.grad = tracker.grad  # type: ignore[assignment]
        undo.enter_context(tracker)
        yield


def locate_breaks(model: nn.Module, call: Callable[[], Any], *, check_nonfinite: bool = False) -> list[Break]:
    """Run ``call()`` once under instrumentation and return every break, in the order they happened.

    De-duplicated by (kind, file, line); a line hit again widens that break's parameters. With
    ``check_nonfinite`` every parameter-dependent op is also checked for NaN/Inf made from finite
    inputs (one host sync per op). If ``call`` raises, the breaks seen so far are added to the
    exception as a note and it is re-raised after cleanup.
    """
    tracker = _Tracker(model, check_nonfinite=check_nonfinite)
    try:
        with _instrumented(tracker):
            call()
    except Exception as err:
        found = "; ".join(f"{b.kind} at {b.file}:{b.line}" for b, _ in tracker.found.values())
        err.add_note(f"gradprobe.locate: breaks before the error: {found or 'none'}")
        raise
    return [brk for brk, _ in tracker.found.values()]


def locate_nonfinite_backward(
    model: nn.Module, call: Callable[[], Mapping[str, Tensor]], term: str
) -> Break | None:
    """The forward line whose backward makes NaN in ``term``'s gradient, or None if it stays finite.

    Runs ``call()`` and the gradient of ``call()[term]`` w.r.t. the parameters under anomaly mode,
    which names the backward node (``op``, e.g. ``ReciprocalBackward0``) and warns with the forward
    stack that made it: the place to fix, usually ``where`` over a singular ``sqrt(0)`` or ``1/0``.
    """
    tracker = _Tracker(model, map_lines=True)
    params = [p for p in model.parameters() if p.requires_grad]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # anomaly mode reports the forward stack as a warning
        with torch.autograd.detect_anomaly(check_nan=True):
            try:
                with _instrumented(tracker):
                    value = call()[term]  # a backward inside the step (forces) is checked too
                if value.requires_grad and params:
                    torch.autograd.grad(value, params, allow_unused=True, retain_graph=False)
                return None
            except RuntimeError as err:
                if (match := _NAN_NODE.search(str(err))) is None:
                    raise
                node = match["node"]
    stacks = [str(w.message) for w in caught if f"Error detected in {node}" in str(w.message)]
    frames = [(m["file"], int(m["line"])) for m in _FRAME.finditer(stacks[-1] if stacks else "")]
    user = [f for f in frames if _is_user_file(f[0])]
    # The innermost user frame made the op. For a double-backward node (a force loss), the text
    # ends with the stack of the forward op that "induced the previous calculation": that op.
    file, line = user[-1] if user else ("", 0)
    module, mtype, bits = tracker.line_info.get((file, line), ("", "", 0))
    code, detail = linecache.getline(file, line).strip(), f"{node} returned NaN in the gradient of {term!r}"
    return Break("nonfinite", node, module, mtype, file, line, code, tracker.names_of(bits), detail)


def module_reach(model: nn.Module, call: Callable[[], Mapping[str, Tensor]], term: str) -> dict[str, str]:
    """For one term: "nonzero" | "zero" | "none", the term's gradient w.r.t. each module's output.

    Covers the modules of ``model.named_modules()`` with a tensor output requiring grad; all tensor
    leaves of tuple/dict outputs and of every call of a module count ("nonzero" if any is nonzero).
    """
    names = {m: n for n, m in model.named_modules()}
    kept: dict[str, list[Tensor]] = {}

    def keep(module: nn.Module, args: Any, output: Any) -> None:
        tensors = [t for t in _tensors(output) if t.requires_grad]
        if module in names and tensors:
            kept.setdefault(names[module], []).extend(tensors)

    handle = register_module_forward_hook(keep)
    try:
        value = call()[term]
    finally:
        handle.remove()
    flat = [t for ts in kept.values() for t in ts]
    if not flat or not value.requires_grad:
        return dict.fromkeys(kept, "none")
    grads = torch.autograd.grad(value, flat, allow_unused=True, retain_graph=True)
    present = [g for g in grads if g is not None]
    # One host sync for all outputs (flags gathered on one device), not one per module.
    flags = [g.ne(0).any().to(present[0].device) for g in present]
    nonzero = iter(torch.stack(flags).tolist() if flags else [])
    status = ["none" if g is None else "nonzero" if next(nonzero) else "zero" for g in grads]
    reach, pos = {}, 0
    for name, ts in kept.items():
        mine, pos = status[pos : pos + len(ts)], pos + len(ts)
        reach[name] = next((s for s in ("nonzero", "zero") if s in mine), "none")
    return reach


def frontier(reach: Mapping[str, str], unreached_params: Iterable[str]) -> list[str]:
    """Per unreached parameter, the innermost module owning it whose output is reached ("nonzero").

    The break is inside that module's forward. If no owner's output is reached, the parameter's
    own module is named (the break is after its output, or the term reaches nothing).
    """
    found: dict[str, None] = {}
    for param in unreached_params:
        parts = param.split(".")[:-1]
        owners = [".".join(parts[:k]) for k in range(len(parts), -1, -1)]  # innermost first, "" last
        found.setdefault(next((m for m in owners if reach.get(m) == "nonzero"), owners[0]))
    return list(found)
