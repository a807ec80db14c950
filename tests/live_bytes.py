"""Peak tensor memory of a call on CPU, where torch keeps no allocator statistics.

A ``TorchDispatchMode`` sees every tensor an op returns; each new storage (not one of the op's inputs:
views and in-place results are no allocation) is counted until it is freed (a weak reference to the
storage, swept before each op). The peak is at op granularity, which is where allocations happen.
Storages that existed before are only counted if first met as an output without being an input
(nothing in torch's ops does that).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created inside the mode that are still alive, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[StorageWeakRef, int] = {}
        self.live = 0
        self.peak = 0

    def _sweep(self) -> None:
        for ref in [r for r in self.storages if r.expired()]:
            self.live -= self.storages.pop(ref)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self._sweep()
        # Storages an op reads were there before it: a view or in-place result sharing one (a
        # parameter's detach()) is not an allocation.
        inputs = {_ref(t) for t in tree_leaves((args, kwargs)) if _counted(t)}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if _counted(t):
                ref = _ref(t)
                if ref not in self.storages and ref not in inputs and (n := t.untyped_storage().nbytes()):
                    self.storages[ref] = n
                    self.live += n
        self.peak = max(self.peak, self.live)
        return out


def _counted(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type == "cpu"


def _ref(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


def peak_bytes(call: Callable[[], Any]) -> tuple[Any, int]:
    """``call()``'s result and the peak of the tensor memory it allocated (beyond what existed)."""
    with LiveBytes() as mode:
        result = call()
    return result, mode.peak


def parameter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
