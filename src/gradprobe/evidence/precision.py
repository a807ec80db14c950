"""The precision a path computes in, observed: one run of the path with compiled code off, under a
dispatch mode that counts the ops whose floating-point results come out in bfloat16 or float16 while
the parameters are float32 or float64 (``torch.autocast`` inside a trainer, or casts in the step).

A path that computes in bfloat16 cannot match a float32 reference at float32's tolerance: autocast in
an opaque trainer gave an error finding with gradients 0.8% off everywhere (a GRU tagger under CPU
bfloat16 autocast), which is bfloat16's rounding, not a wrong value. The comparison then uses the
tolerance of the precision observed (``compare.tolerance``), and the flow map says so. Nothing is
asked of the path: autocast and casts are visible below autograd, where the dispatch mode sits
(measured on torch 2.13: autocast's casts and the bfloat16 ``addmm`` reach the mode, also for a
``torch.compile``'d function run under the ``force_eager`` stance).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .lineage import force_eager

# Autocast levels by the dtype seen, as the variants' own ``autocast`` knob spells them.
LEVEL = {torch.bfloat16: "bf16", torch.float16: "fp16"}
DTYPE_NAME = {"bf16": "bfloat16", "fp16": "float16"}
PRODUCTS = ("mm", "conv", "linear", "attention", "rnn", "gru", "lstm", "matmul", "einsum")


class _LowPrecisionOps(TorchDispatchMode):
    """Counts ops (by name) with a bfloat16 or float16 result; views are not counted (they compute
    nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[torch.dtype, Counter[str]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.dtype in LEVEL:
                    self.ops.setdefault(t.dtype, Counter())[str(func.overloadpacket)] += 1
        return out


def observe(run: Callable[[], Any], parameter_dtype: torch.dtype) -> dict[str, Any] | None:
    """Run ``run()`` once (compiled code off) and return ``{"level": "bf16"|"fp16", "dtype": ...,
    "ops": {op: count}}`` for the lowest precision its results came out in, or None when every result
    was at least as precise as the parameters (or the parameters are half precision themselves, or the
    run failed: its measured runs record that)."""
    if parameter_dtype not in (torch.float32, torch.float64):
        return None
    seen = _LowPrecisionOps()
    try:
        with force_eager(), seen:
            run()
    except Exception:  # the path's own failure is recorded by its measured runs
        return None
    if not seen.ops:
        return None
    # bfloat16 has the shorter mantissa: its tolerance governs where both were seen.
    dtype = torch.bfloat16 if torch.bfloat16 in seen.ops else torch.float16
    ops = seen.ops[dtype]
    # Products first (where the rounding matters most), then by count.
    ordered = sorted(ops.items(), key=lambda kv: (not any(p in kv[0] for p in PRODUCTS), -kv[1]))
    return {
        "level": LEVEL[dtype],
        "dtype": DTYPE_NAME[LEVEL[dtype]],
        "ops": dict(ordered),
        "count": sum(ops.values()),
    }
