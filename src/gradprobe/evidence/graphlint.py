"""Lint of a traced FX graph: facts a traced variant's diagnosis needs, with source lines.

``make_fx`` is run by gradprobe with ``record_stack_traces=True`` and ``record_module_stack=True``, so
nodes map back to module and source line; for graphs gradprobe did not trace, node names suffice.
"""

from __future__ import annotations

from typing import Any

import torch

from ..frames import user_frame_in_stack_trace


def _describe(node: torch.fx.Node) -> dict[str, Any]:
    where = user_frame_in_stack_trace(node.meta.get("stack_trace")) or {}
    target = node.target
    return {"node": node.name, "op": getattr(target, "__name__", str(target)), **where}


def _parameter_attrs(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """``get_attr`` nodes holding a tensor that requires grad: parameters a trace baked in (make_fx of a
    module's method with real parameters records them as ``_param_constant*`` attributes)."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        value: Any = gm
        try:
            for part in str(n.target).split("."):
                value = getattr(value, part)
        except AttributeError:
            continue
        if isinstance(value, torch.Tensor) and value.requires_grad:
            out.append(n)
    return out


def lint(gm: torch.fx.GraphModule, n_params: int = 0) -> dict[str, Any]:
    """Detach nodes that cut a parameter's gradient path: ``make_fx`` records ``detach`` on tensors
    saved for backward, which cuts second-order gradients (PyTorch #175477). The first ``n_params``
    placeholders are the parameters, and so is any ``get_attr`` tensor that requires grad; a detach
    whose input does not depend on them (coordinates, indices) is harmless and not counted. Reports
    the first one's node, the producing op of the saved tensor and its source line, and the node count."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    depends: set[torch.fx.Node] = set(placeholders[:n_params]) | set(_parameter_attrs(gm))
    for n in gm.graph.nodes:
        if n.op == "call_function" and any(a in depends for a in n.all_input_nodes):
            depends.add(n)
    detach = [
        n for n in gm.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.detach.default
    ]
    cutting = [n for n in detach if n.args and n.args[0] in depends]
    first = None
    if cutting:
        n = cutting[0]
        producer = n.args[0]
        first = {
            **_describe(n),
            "saved": _describe(producer) if isinstance(producer, torch.fx.Node) else None,
        }
    return {
        "nodes": len(gm.graph.nodes),
        "detach_nodes": len(detach),
        "cutting_detach_nodes": len(cutting),
        "detach_node_names": [n.name for n in cutting[:20]],
        "first_detach": first,
    }
