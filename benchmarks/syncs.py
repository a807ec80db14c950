"""Counting device-to-host synchronisations, on a machine that has no device.

On a GPU, the host waits for the device whenever a value must come back to Python: ``.item()``,
``bool(t)``, ``float(t)`` (all ``aten._local_scalar_dense``), ``torch.equal`` and data-dependent
shapes (``aten.nonzero``), ``.cpu()`` / ``.tolist()`` / ``.numpy()`` of a device tensor, and
``aten._to_copy`` / ``aten.copy_`` into a CPU tensor from a device tensor. On this CPU-only machine
nothing actually waits, and ``.cpu()`` / ``.tolist()`` of a CPU tensor never reach the dispatcher, so
``SyncCounter`` counts the *calls that would sync on a GPU*, by name:

* a ``TorchDispatchMode`` counts ``aten._local_scalar_dense``, ``aten.equal``, ``aten.nonzero``,
  ``aten.masked_select`` and ``aten._to_copy`` / ``aten.copy_`` with a CPU destination and a
  non-CPU source (never seen here, counted for completeness);
* a ``TorchFunctionMode`` counts ``Tensor.cpu()``, and ``Tensor.tolist()`` / ``Tensor.numpy()``
  except on a tensor that a counted ``.cpu()`` just returned (``x.cpu().tolist()`` is one sync).
  ``item()``, ``bool()`` and ``float()`` are not counted here: they reach the dispatcher as
  ``_local_scalar_dense`` and are counted there once.

Not counted: ``.to(device)``. Here every device is the CPU, so a device-to-device move (gradprobe
moves term values to the first term's device) cannot be told apart from a copy to the host.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_DISPATCH_SYNCS = {"_local_scalar_dense", "equal", "nonzero", "masked_select"}
_COPIES = {"_to_copy", "copy_"}


def _is_cpu(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "cpu"


class _Dispatch(TorchDispatchMode):
    def __init__(self, counts: Counter[str]) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        out = func(*args, **kwargs)
        if name in _DISPATCH_SYNCS:
            self.counts[f"aten.{name}"] += 1
        elif name in _COPIES and args and isinstance(args[0], torch.Tensor):
            dst = out if name == "_to_copy" else args[0]
            src = args[0] if name == "_to_copy" else args[1]
            if _is_cpu(dst) and isinstance(src, torch.Tensor) and not _is_cpu(src):
                self.counts[f"aten.{name} to cpu"] += 1
        return out


class _Function(TorchFunctionMode):
    def __init__(self, counts: Counter[str]) -> None:
        super().__init__()
        self.counts = counts
        self._from_cpu_call: dict[int, torch.Tensor] = {}  # id -> tensor (kept alive: ids stay unique)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        out = func(*args, **kwargs)
        if name == "cpu":
            self.counts["Tensor.cpu"] += 1
            self._from_cpu_call[id(out)] = out
        elif name in ("tolist", "numpy") and args and id(args[0]) not in self._from_cpu_call:
            self.counts[f"Tensor.{name}"] += 1
        return out


class SyncCounter:
    """``with SyncCounter() as c: ...``; then ``c.total`` and ``c.counts`` (by op name)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._modes = (_Function(self.counts), _Dispatch(self.counts))

    def __enter__(self) -> SyncCounter:
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)
        self._modes[0]._from_cpu_call.clear()

    @property
    def total(self) -> int:
        return sum(self.counts.values())
