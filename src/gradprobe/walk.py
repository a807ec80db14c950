"""One walk of a model's module tree for everything the probe lists: its modules, named parameters and
named buffers, in the order and with the names ``named_modules``, ``named_parameters`` and
``named_buffers`` give (each deduplicated by identity, ``None`` entries skipped).

Three separate walks cost about 1.6 ms at 2,000 parameter tensors (``named_parameters`` alone 0.9 ms:
a generator and a memo per member); one costs a third of that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tree:
    modules: list[torch.nn.Module]
    parameters: list[tuple[str, torch.nn.Parameter]]
    buffers: list[tuple[str, torch.Tensor]]


def walk(model: torch.nn.Module) -> Tree:
    modules: list[torch.nn.Module] = []
    parameters: list[tuple[str, torch.nn.Parameter]] = []
    buffers: list[tuple[str, torch.Tensor]] = []
    # Ids of the tensors listed, one set for each kind as torch keeps: a tensor shared by two modules
    # is listed once, under the first name.
    seen_p: set[int] = set()
    seen_b: set[int] = set()
    for prefix, module in model.named_modules():
        modules.append(module)
        own_p, own_b = module._parameters, module._buffers
        if not (own_p or own_b):
            continue
        dot = prefix + "." if prefix else ""
        for name, p in own_p.items():
            if p is not None and id(p) not in seen_p:
                seen_p.add(id(p))
                parameters.append((dot + name, p))
        for name, b in own_b.items():
            if b is not None and id(b) not in seen_b:
                seen_b.add(id(b))
                buffers.append((dot + name, b))
    return Tree(modules, parameters, buffers)
