"""Claims cases (issue 32, "Say only what was measured").

Every case is a small training setup of its own family (none of them the zoo's potential or a model of
``tests/cases``). A case is a plain function ``build(fixed) -> (model, step, batch, probe_kwargs)``
registered with ``@case(...)``; ``probe_kwargs`` are the other arguments of ``gradprobe.probe``
(``variants``, ``terms``, ``notes``...). A bug case is registered with its fixed twin (the same
function with ``fixed=True``); an intended stop-gradient, a declared cut, is registered alone.

Source markers, at the end of a line:

- ``# ROOT <case id>``: the line the main error finding of that bug case must name (exactly one);
- ``# STOP <case id>``: the construct of an intended stop-gradient (one or more lines: a ``with
  torch.no_grad():`` block marks its ``with`` line and the lines inside it). A ``stop-gradient``
  warning, if one is given, must name one of them.

Each case also has a ``truth(fixed)``: plain torch, no gradprobe, proving the bug is real (or gone)
or that the intended cut exists.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import os
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

Built = tuple[torch.nn.Module, Callable[..., Any], Any, dict[str, Any]]

MODULES = (
    "hamiltonian",
    "char_lm",
    "tabular",
    "adversarial",
    "siamese",
    "q_learning",
    "probing",
    "speaker",
    "sequence",
    "retrieval",
    "denoise",
    "force_field",
    "video",
    "actor_critic",
    "gradient_penalty",
    "vector_quantised",
)


@dataclass(frozen=True)
class Entry:
    """One registered case. ``kind``: ``"bug"``, ``"twin"`` or ``"intended"``."""

    id: str
    kind: str
    family: str
    mechanism: str
    container: str  # "reference" | "opaque-eager" | "opaque-compiled"
    expect: frozenset[str]
    make: Callable[[], Built]
    fixed: bool
    file: str
    of: str  # the bug case a twin belongs to ("" otherwise)
    # The severity the main finding of a bug case must have: an error, or a warning where only the user
    # can know whether the construct is meant (an explicit stop-gradient the step works around, a custom
    # Function's surrogate gradient) and the tool asks.
    severity: str = "error"

    @property
    def root_line(self) -> int | None:
        """The ``# ROOT`` line of a bug case."""
        if self.kind != "bug":
            return None
        (line,) = marked(self.file, "ROOT", self.id, at_least=1, at_most=1)
        return line

    @property
    def stop_lines(self) -> tuple[int, ...]:
        """The ``# STOP`` lines of an intended case (and of a twin whose bug keeps one)."""
        key = self.of or self.id
        return tuple(marked(self.file, "STOP", key, at_least=0, at_most=99))


_REGISTRY: dict[str, Entry] = {}
_TRUTHS: dict[str, Callable[[bool], None]] = {}


def marked(file: str, tag: str, case_id: str, *, at_least: int, at_most: int) -> list[int]:
    """The 1-based numbers of the lines of ``file`` ending in ``# <tag> <case_id>``."""
    suffix = f"# {tag} {case_id}"
    lines = Path(file).read_text().splitlines()
    hits = [n for n, text in enumerate(lines, 1) if text.rstrip().endswith(suffix)]
    if not at_least <= len(hits) <= at_most:
        raise AssertionError(f"{os.path.basename(file)}: {len(hits)} '{suffix}' markers")
    return hits


def case(
    case_id: str,
    *,
    family: str,
    mechanism: str,
    container: str = "reference",
    expect: Iterable[str] = (),
    intended: bool = False,
    severity: str = "error",
) -> Callable[[Callable[[bool], Built]], Callable[[bool], Built]]:
    """Register ``build(fixed)``: a bug case and its twin ``<id>-fixed``, or (``intended=True``) one
    intended case that must give no error."""
    file = inspect.stack()[1].filename

    def register(build: Callable[[bool], Built]) -> Callable[[bool], Built]:
        def add(cid: str, kind: str, fixed: bool, expected: frozenset[str], of: str) -> None:
            if cid in _REGISTRY:
                raise AssertionError(f"case {cid} registered twice")
            _REGISTRY[cid] = Entry(
                id=cid,
                kind=kind,
                family=family,
                mechanism=mechanism,
                container=container,
                expect=expected,
                make=lambda: build(fixed),
                fixed=fixed,
                file=file,
                of=of,
                severity=severity if kind == "bug" else "error",
            )

        if intended:
            add(case_id, "intended", False, frozenset(), "")
        else:
            assert expect, case_id
            add(case_id, "bug", False, frozenset(expect), "")
            add(f"{case_id}-fixed", "twin", True, frozenset(), case_id)
        return build

    return register


def truth(case_id: str) -> Callable[[Callable[[bool], None]], Callable[[bool], None]]:
    """Register the plain-torch truth check of a case (``fixed`` as for its build)."""

    def register(check: Callable[[bool], None]) -> Callable[[bool], None]:
        _TRUTHS[case_id] = check
        return check

    return register


def entries() -> list[Entry]:
    for name in MODULES:
        importlib.import_module(f"{__name__}.{name}")
    return list(_REGISTRY.values())


def truth_of(entry: Entry) -> Callable[[], None] | None:
    """The truth check of a case (its bug's check, with ``fixed`` set, for a twin)."""
    check = _TRUTHS.get(entry.of or entry.id)
    return None if check is None else (lambda: check(entry.fixed))


# ----- plain-torch tools for the truth checks ---------------------------------------------------------


def params_of(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {k: p for k, p in model.named_parameters() if p.requires_grad}


def autograd_of(value: torch.Tensor, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """``d value / d p`` per parameter; None where autograd finds no path."""
    if not value.requires_grad:
        return dict.fromkeys(params)
    got = torch.autograd.grad(value, list(params.values()), allow_unused=True)
    return dict(zip(params, got, strict=True))


def reached(g: torch.Tensor | None) -> bool:
    return g is not None and bool(g.abs().sum() > 0)


def fd_vs_autograd(
    value: Callable[[], torch.Tensor], params: dict[str, torch.Tensor], eps: float = 1e-5, seed: int = 7
) -> dict[str, tuple[float, float]]:
    """Per parameter tensor: (central finite difference of ``value()`` along a random direction,
    autograd's directional derivative along it). Parameters are restored exactly."""
    out: dict[str, tuple[float, float]] = {}
    gen = torch.Generator().manual_seed(seed)
    grads = autograd_of(value(), params)
    for name, p in params.items():
        d = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        saved = p.detach().clone()
        try:
            with torch.no_grad():
                p.add_(eps * d)
            plus = float(value().detach())
            with torch.no_grad():
                p.copy_(saved - eps * d)
            minus = float(value().detach())
        finally:
            with torch.no_grad():
                p.copy_(saved)
        g = grads[name]
        out[name] = ((plus - minus) / (2 * eps), 0.0 if g is None else float((g * d).sum()))
    return out


def worst_disagreement(pairs: dict[str, tuple[float, float]]) -> float:
    """The largest relative error of autograd's directional derivative against the finite difference,
    over the parameter tensors (each relative to its own finite difference, floored at 1% of the
    largest one so that a tensor the value hardly moves with does not dominate)."""
    floor = 0.01 * max(abs(fd) for fd, _ in pairs.values())
    return max(abs(fd - ad) / max(abs(fd), floor) for fd, ad in pairs.values())


def moves(value: Callable[[], torch.Tensor], p: torch.Tensor, eps: float = 1e-4) -> float:
    """How much ``value()`` changes when ``p`` moves by ``eps`` along a fixed random direction."""
    before = float(value().detach())
    saved = p.detach().clone()
    d = torch.randn(p.shape, generator=torch.Generator().manual_seed(3), dtype=p.dtype)
    try:
        with torch.no_grad():
            p.add_(eps * d)
        return abs(float(value().detach()) - before)
    finally:
        with torch.no_grad():
            p.copy_(saved)


def ones_for(terms: Sequence[str], on: Sequence[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Per-term 0-dim weights: 1 for ``on``, 0 for the rest."""
    return {t: torch.tensor(1.0 if t in on else 0.0, dtype=dtype) for t in terms}


def grown(seed: int, make: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """``make()`` in float64 with torch's RNG seeded by ``seed``; the caller's RNG state is kept."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make().double()


_COPIES = itertools.count()


def new_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with code objects of its own (a per-call name suffix), so that dynamo, which caches
    compiled frames per code object, compiles each build of a case afresh, as a new process would.
    Files and line numbers are kept."""
    assert isinstance(fn, types.FunctionType)
    tag = f"__claim{next(_COPIES)}"

    def rename(code: types.CodeType) -> types.CodeType:
        consts = tuple(rename(c) if isinstance(c, types.CodeType) else c for c in code.co_consts)
        return code.replace(co_consts=consts, co_name=code.co_name + tag, co_qualname=code.co_qualname + tag)

    out = types.FunctionType(
        rename(fn.__code__), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


def weighted(terms: dict[str, torch.Tensor], weights: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(sum of weights[t] * value, terms)``: what a user path's ``run(batch, weights)`` returns."""
    names = list(terms)
    total = weights[names[0]] * terms[names[0]]
    for name in names[1:]:
        total = total + weights[name] * terms[name]
    return total, terms
