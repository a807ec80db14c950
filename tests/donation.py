"""AOTAutograd's buffer donation switched for one block (tests of donated-buffers; aot_eager only: never
against a shared inductor cache, where flipping it gave silently wrong gradients)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def donation(on: bool) -> Iterator[None]:
    import torch._functorch.config as functorch_config

    saved = functorch_config.donated_buffer
    functorch_config.donated_buffer = on
    try:
        yield
    finally:
        functorch_config.donated_buffer = saved
