"""Cases written unlike the zoo: other model families, other names, other batch keys, other bug places.

Each case is a small, real training setup with one known bug (or none: a fixed twin or a healthy
case). Most put the bug only inside an execution path registered as an *opaque* user variant: a
plain ``run(batch, weights)`` callable with no graph, no counter and no knobs, the way a user's own
compiled trainer reaches gradprobe. The detectors are never told anything about a case: the test
probes it and compares the findings with ``Case.expect`` and with the line marked in the source.

Names are parameters (``Names``): the renaming test builds every case again with random term,
batch-key, parameter and variant names and expects the same causes and lines.

A bug line carries the marker comment ``# BUG <case id>`` at its end; ``marked_line`` finds it, so
expectations survive edits of the file.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import random
import string
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import gradprobe
from gradprobe.variants import VariantSpec, user_variant


@dataclass(frozen=True)
class Names:
    """Every name a case uses for terms, batch keys, submodules and variants.

    ``term("recon")`` returns the name of the term a case calls "recon"; the default instance maps
    each name to itself, ``Names.random(seed)`` maps each to a random identifier (stable per name).
    """

    salt: str = ""

    def _name(self, kind: str, base: str) -> str:
        if not self.salt:
            return base
        rng = random.Random(f"{self.salt}:{kind}:{base}")
        return rng.choice(string.ascii_lowercase) + "".join(
            rng.choice(string.ascii_lowercase + string.digits) for _ in range(7)
        )

    def term(self, base: str) -> str:
        return self._name("term", base)

    def key(self, base: str) -> str:
        return self._name("key", base)

    def attr(self, base: str) -> str:
        """A submodule or parameter attribute name (set with setattr, read with getattr)."""
        return self._name("attr", base)

    def variant(self, base: str) -> str:
        return self._name("variant", base)

    @classmethod
    def random(cls, seed: int) -> Names:
        return cls(salt=f"rename{seed}")


@dataclass
class Setup:
    """What a case hands to ``gradprobe.probe``: a spec and the variants (the reference first)."""

    spec: gradprobe.ProbeSpec
    variants: Sequence[str | VariantSpec]
    checks: Sequence[str] = ()


@dataclass(frozen=True)
class Case:
    """One case.

    ``expect``: the exact set of error-severity causes the probe must report (empty for twins and
    healthy cases). ``where``: the id of the case whose ``# BUG`` marker names the line the main
    finding must point at (``None``: no line expected, e.g. a guard reason or a graph node only).
    ``node``: the prefix of the FX graph node the finding must name (make_fx replays). ``truth``:
    an independent check with plain torch that the bug is real (or absent), run by the tests too.
    """

    id: str
    family: str
    mechanism: str
    container: str  # "reference" | "opaque-compiled" | "opaque-eager" | "make_fx-replay"
    build: Callable[[Names], Setup]
    expect: frozenset[str] = frozenset()
    where: str | None = None
    node: str | None = None
    twin_of: str | None = None
    healthy: bool = False
    truth: Callable[[Names], None] | None = None
    notes: str = ""
    file: str = field(default="", compare=False)

    @property
    def is_bug(self) -> bool:
        return bool(self.expect)


def marked_line(module_file: str, case_id: str) -> int:
    """The line number carrying ``# BUG <case_id>`` in ``module_file`` (exactly one)."""
    lines = Path(module_file).read_text().splitlines()
    hits = [i + 1 for i, text in enumerate(lines) if text.rstrip().endswith(f"# BUG {case_id}")]
    if len(hits) != 1:
        raise AssertionError(f"expected one '# BUG {case_id}' marker in {module_file}, found {len(hits)}")
    return hits[0]


def opaque(name: str, make_run: Callable[[Any], Callable[[Any, Any], Any]]) -> VariantSpec:
    """A user variant that hands over only a plain ``run(batch, weights)``: no graph, no counter, no
    knobs. ``make_run(ctx)`` gets gradprobe's build context (``ctx.model``, ``ctx.batch``)."""
    return user_variant(name, make_run)


def weighted_total(terms: dict[str, torch.Tensor], weights: Any) -> torch.Tensor:
    """``sum(weights[t] * value)`` over the terms, the way a trainer applies per-term weights."""
    total = None
    for name, value in terms.items():
        part = weights[name] * value
        total = part if total is None else total + part
    assert total is not None
    return total


def case_file() -> str:
    """The file of the calling case module (for ``Case.file``)."""
    return inspect.stack()[1].filename


# ----- helpers for the family modules ------------------------------------------------------------


def with_twin(bug: Case, build: Callable[..., Setup], truth: Callable[..., None] | None = None) -> list[Case]:
    """``bug`` (its ``build``/``truth`` set from ``build(names, bug=True)``) and its fixed twin: the
    same code with ``bug=False``, id ``<bug id>-fixed``, no expected error, no location."""
    buggy = dataclasses.replace(
        bug,
        build=functools.partial(build, bug=True),
        truth=None if truth is None else functools.partial(truth, bug=True),
    )
    twin = dataclasses.replace(
        bug,
        id=f"{bug.id}-fixed",
        build=functools.partial(build, bug=False),
        truth=None if truth is None else functools.partial(truth, bug=False),
        expect=frozenset(),
        where=None,
        node=None,
        twin_of=bug.id,
    )
    return [buggy, twin]


_BUILDS = itertools.count()


def fresh(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of a plain function that dynamo sees as new code, as in a fresh trainer process.

    A case is built many times in one session, and dynamo remembers code in two ways that would leak
    from one build into the next: compiled frames per code object, and "automatic dynamic" state
    (a value that recompiled once is traced as symbolic from then on) per (file, first line, name).
    So the copy's code objects, and every nested one, get a per-build name suffix; files and line
    numbers stay the same (guards and stack traces still point at the case's lines)."""
    assert isinstance(fn, types.FunctionType)
    suffix = f"_build{next(_BUILDS)}"

    def renamed(code: types.CodeType) -> types.CodeType:
        consts = tuple(renamed(c) if isinstance(c, types.CodeType) else c for c in code.co_consts)
        return code.replace(
            co_consts=consts, co_name=code.co_name + suffix, co_qualname=code.co_qualname + suffix
        )

    copy = types.FunctionType(
        renamed(fn.__code__), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    copy.__qualname__ = fn.__qualname__
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Draw from torch's global RNG with ``seed`` inside the block; the caller's RNG state is kept."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def stand_in(setup: Setup) -> types.SimpleNamespace:
    """The build context a user variant gets, as far as the cases use it (``.model``, ``.batch``)."""
    return types.SimpleNamespace(model=setup.spec.model, batch=setup.spec.batch)


def user_run(setup: Setup, index: int = -1) -> Callable[[Any, Any], Any]:
    """The ``run(batch, weights)`` of the setup's opaque variant (the last one by default), built the
    way gradprobe builds it."""
    variant = setup.variants[index]
    assert isinstance(variant, VariantSpec) and variant.builder is not None
    return variant.builder(stand_in(setup))


def term_weights(terms: Sequence[str], on: Sequence[str], like: torch.Tensor) -> dict[str, torch.Tensor]:
    """1 for the terms in ``on``, 0 for the others, as 0-dim tensors of ``like``'s dtype."""
    return {t: torch.tensor(1.0 if t in on else 0.0, dtype=like.dtype) for t in terms}


def grads(value: torch.Tensor, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """``d value / d p`` for each parameter (None where the graph does not reach it)."""
    if not value.requires_grad:
        return dict.fromkeys(params)
    got = torch.autograd.grad(value, list(params.values()), allow_unused=True, retain_graph=True)
    return dict(zip(params, got, strict=True))


def is_cut(g: torch.Tensor | None) -> bool:
    """No gradient, or an exactly zero one."""
    return g is None or not bool(g.abs().sum() > 0)


def nudge(value: Callable[[], torch.Tensor], param: torch.Tensor, eps: float = 1e-4) -> float:
    """How much ``value()`` moves when ``param`` moves by ``eps`` times its scale in a fixed random
    direction (not a uniform shift: a softmax is blind to that); restored exactly afterwards."""
    before = float(value().detach())
    saved = param.detach().clone()
    g = torch.Generator().manual_seed(0)
    direction = torch.randn(saved.shape, generator=g, dtype=saved.dtype)
    with torch.no_grad():
        param.add_(eps * (saved.abs().mean() + 1.0) * direction)
    try:
        after = float(value().detach())
    finally:
        with torch.no_grad():
            param.copy_(saved)
    return abs(after - before)


# One module per model family; each defines CASES.
FAMILIES = ("pair_potential", "text_tagger", "vae", "graph_net", "pinn")


def all_cases() -> list[Case]:
    """Every case of every family module, in a stable order."""
    import importlib

    out: list[Case] = []
    for family in FAMILIES:
        out.extend(importlib.import_module(f"{__name__}.{family}").CASES)
    ids = [c.id for c in out]
    if len(ids) != len(set(ids)):
        raise AssertionError(f"duplicate case ids: {sorted(i for i in ids if ids.count(i) > 1)}")
    return out
