"""The random number streams a step may draw from: torch's (CPU and each accelerator), Python's ``random``
and NumPy's legacy global RNG. Saved, restored and seeded here only, through their public APIs, as
PyTorch's own dynamo does around every frame it compiles (``random.getstate``,
``torch.random.get_rng_state``). A NumPy ``Generator`` a user holds is the user's own object: not touched.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

# Accelerators torch may be built with; each has ``is_available`` and ``manual_seed_all``. Seeding is
# done per device rather than through ``torch.manual_seed``, which also queues a lazy seed (with a
# formatted stack, 0.15 ms) for every device module that is not available.
_ACCELERATORS = ("cuda", "xpu", "mtia")


@dataclass(frozen=True)
class RngState:
    torch_cpu: torch.Tensor
    cuda: list[torch.Tensor] | None  # None: CUDA not initialised, so it has no state to restore
    python: Any
    numpy: Any  # np.random.get_state(), or None when NumPy was never imported


def save_rng() -> RngState:
    np = sys.modules.get("numpy")  # not imported by the user: nothing of theirs to keep
    return RngState(
        torch.random.get_rng_state(),
        torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        random.getstate(),
        np.random.get_state() if np is not None else None,
    )


def restore_rng(saved: RngState) -> None:
    torch.random.set_rng_state(saved.torch_cpu)
    if saved.cuda is not None:
        torch.cuda.set_rng_state_all(saved.cuda)
    random.setstate(saved.python)
    if saved.numpy is not None:
        sys.modules["numpy"].random.set_state(saved.numpy)


def reseed(seed: int) -> None:
    """Seed every stream a step may draw from, so that each run of a probe sees the same numbers."""
    torch.default_generator.manual_seed(seed)
    for name in _ACCELERATORS:
        device = getattr(torch, name, None)
        if device is not None and device.is_available():
            device.manual_seed_all(seed)
    if torch.backends.mps.is_available():
        torch.mps.manual_seed(seed)
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed % 2**32)


@contextmanager
def kept_rng(seed: int | None = None) -> Iterator[None]:
    """The body runs (from ``seed`` when given) and leaves every stream as it found it."""
    saved = save_rng()
    try:
        if seed is not None:
            reseed(seed)
        yield
    finally:
        restore_rng(saved)
