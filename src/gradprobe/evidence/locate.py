"""Where a gradient chain breaks: the module, op and source line that cut a term off some parameters.

``locate_breaks`` runs the step once under the lineage recorder (``evidence.lineage``: which parameters
each tensor depends on, and where that dependence stops carrying gradient) and returns its cut sites
as ``Break`` records. ``locate_nonfinite_backward`` finds the forward line whose backward makes NaN;
``module_reach``/``frontier`` bracket a break between module outputs. All that is installed is removed
on exit; modes, grad mode and ``.grad`` are never touched.
"""

from __future__ import annotations

import contextlib
import linecache
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_hook

from ..frames import is_user_file
from .lineage import CutSite, recording, tensors_in

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


def locate_breaks(model: nn.Module, call: Callable[[], Any], *, check_nonfinite: bool = False) -> list[Break]:
    """Run ``call()`` once under the lineage recorder and return every break, in the order they happened.

    A break is a cut site of ``evidence.lineage`` over ``model.named_parameters()``: de-duplicated by
    (kind, file, line); a line hit again widens that break's parameters. With ``check_nonfinite``
    every parameter-dependent op is also checked for NaN/Inf made from finite inputs (one host sync per
    op). If ``call`` raises, the breaks seen so far are added to the exception as a note and it is
    re-raised after cleanup.
    """
    with contextlib.ExitStack() as stack:
        rec = stack.enter_context(
            recording(model, list(model.named_parameters()), check_nonfinite=check_nonfinite)
        )
        try:
            call()
        except Exception as err:
            found = "; ".join(f"{s.kind} at {s.file}:{s.line}" for s in rec.cut_sites())
            err.add_note(f"gradprobe.locate: breaks before the error: {found or 'none'}")
            raise
    return [_as_break(s) for s in rec.cut_sites()]


def _as_break(site: CutSite) -> Break:
    return Break(site.kind, site.op, site.module, site.module_type, site.file, site.line, site.code,
                 site.parameters, site.detail)  # fmt: skip


def locate_nonfinite_backward(
    model: nn.Module, call: Callable[[], Mapping[str, Tensor]], term: str
) -> Break | None:
    """The forward line whose backward makes NaN in ``term``'s gradient, or None if it stays finite.

    Runs ``call()`` and the gradient of ``call()[term]`` w.r.t. the parameters under anomaly mode,
    which names the backward node (``op``, e.g. ``ReciprocalBackward0``) and warns with the forward
    stack that made it: the place to fix, usually ``where`` over a singular ``sqrt(0)`` or ``1/0``.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # anomaly mode reports the forward stack as a warning
        with torch.autograd.detect_anomaly(check_nan=True):
            try:
                with recording(model, list(model.named_parameters()), map_lines=True) as rec:
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
    user = [f for f in frames if is_user_file(f[0])]
    # The innermost user frame made the op. For a double-backward node (a force loss), the text
    # ends with the stack of the forward op that "induced the previous calculation": that op.
    file, line = user[-1] if user else ("", 0)
    module, mtype, bits = rec.line_info.get((file, line), ("", "", 0))
    code, detail = linecache.getline(file, line).strip(), f"{node} returned NaN in the gradient of {term!r}"
    return Break("nonfinite", node, module, mtype, file, line, code, rec.names_of(bits), detail)


def module_reach(model: nn.Module, call: Callable[[], Mapping[str, Tensor]], term: str) -> dict[str, str]:
    """For one term: "nonzero" | "zero" | "none", the term's gradient w.r.t. each module's output.

    Covers the modules of ``model.named_modules()`` with a tensor output requiring grad; all tensor
    leaves of tuple/dict outputs and of every call of a module count ("nonzero" if any is nonzero).
    """
    names = {m: n for n, m in model.named_modules()}
    kept: dict[str, list[Tensor]] = {}

    def keep(module: nn.Module, args: Any, output: Any) -> None:
        tensors = [t for t in tensors_in(output) if t.requires_grad]
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
