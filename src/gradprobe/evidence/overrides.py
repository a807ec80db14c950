"""Flips that need no cooperation from a path: for bisecting a user's path that declares no knobs.

* ``force_eager``: run the path under ``torch.compiler.set_stance("force_eager")``. Compiled functions
  anywhere inside the user's callable run their Python (``fullgraph=True`` ones too); a ``make_fx``
  replay is not changed. If the flow comes back, the break is in compilation, not in the Python.
* ``backend override``: rebuild the path while ``torch.compile()`` is made to pick another backend, the
  way ``torch._inductor.compiler_bisector`` does it (``CompilerBisector.get_backend``, read by every
  ``torch.compile()`` call). It only reaches functions the builder wraps *while* it builds: a path
  wrapped at import time is reported "not overridable". Dynamo's caches are reset before each rebuild,
  so compiled code of another backend is not reused.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..variants import VariantSpec
from .lineage import force_eager


@contextlib.contextmanager
def backend_override(backend: str) -> Iterator[list[int]]:
    """Every ``torch.compile()`` called inside uses ``backend``; yields a one-item list counting them
    (it stays 0 on a torch without ``CompilerBisector``, torch < 2.6: nothing can be overridden)."""
    calls = [0]
    try:
        from torch._inductor.compiler_bisector import CompilerBisector
    except ImportError:
        yield calls
        return

    original = CompilerBisector.__dict__["get_backend"]

    def get_backend(cls: Any) -> str:
        calls[0] += 1
        return backend

    CompilerBisector.get_backend = classmethod(get_backend)  # type: ignore[method-assign,assignment]
    try:
        yield calls
    finally:
        CompilerBisector.get_backend = original  # type: ignore[method-assign]


def _wrapped(v: VariantSpec, suffix: str, builder: Callable[[Any], Any]) -> VariantSpec:
    name = f"{v.name}[{suffix}]"
    return dataclasses.replace(v, name=name, builder=builder, base=name, user_knobs={}, knobs={})


def under_force_eager(v: VariantSpec) -> VariantSpec:
    """The same path, run under the ``force_eager`` stance."""
    from ..build import Built

    original = v.builder
    assert original is not None

    def builder(ctx: Any) -> Any:
        made = original(dataclasses.replace(ctx, knobs={**v.knobs}))
        run = made.run if isinstance(made, Built) else made
        if run is None:
            return made

        def eager_run(batch: Any, weights: Any) -> Any:
            with force_eager():
                return run(batch, weights)

        return Built(run=eager_run)  # no counter: under the stance nothing compiled runs

    return _wrapped(v, "stance=force_eager", builder)


def with_backend(v: VariantSpec, backend: str, calls: list[int]) -> VariantSpec:
    """The same path rebuilt with every ``torch.compile()`` of its builder overridden to ``backend``;
    ``calls[0]`` counts the ``torch.compile()`` calls the rebuild made (0: not overridable)."""
    original = v.builder
    assert original is not None

    def builder(ctx: Any) -> Any:
        torch._dynamo.reset()
        with backend_override(backend) as seen:
            made = original(dataclasses.replace(ctx, knobs={**v.knobs}))
        calls[0] += seen[0]
        return made

    return _wrapped(v, f"backend={backend}", builder)
