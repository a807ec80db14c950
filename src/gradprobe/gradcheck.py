"""The ``gradients`` check: is autograd's gradient of each term the derivative of the term's value?

Counts and statuses cannot see a cut that leaves every parameter reached (``autograd.grad`` without
``create_graph`` on one of two derivative paths, a weight used once through ``.data``), nor a custom
``autograd.Function`` whose backward is not its forward's derivative. Finite differences of the term's
own value can. For each path and term:

1. autograd's gradient of the term, through that path, on the parameters (one forward and backward);
2. central differences of the term's value along a few random directions ``d`` in parameter space (each
   parameter tensor perturbed in proportion to its own magnitude), at two step sizes ``h`` and ``2h``;
3. the directional derivative ``<grad, d>`` against the difference quotient: they disagree when the gap
   exceeds what the arithmetic explains (the two step sizes' gap, rounding at this precision, and a
   floor per dtype, ``DETECTABLE``). Where the two step sizes disagree with each other the value is not
   smooth there (a ReLU kink, a routing switch crossed): that direction is *undecided*, not a finding;
4. a disagreement is localised along directions confined to one module's parameters, then to one tensor.

Every evaluation starts from the probe's seeded RNG state and the saved buffers (dropout draws the same
mask, BatchNorm's running statistics do not drift), so both sides see the same function. The reference
path is evaluated on a float64 copy of the model where one can be made and run; every other path, and
a model that refuses the copy or float64, in the model's own dtype, on the model itself (perturbed
through ``.data`` and put back exactly after each evaluation; the probe's state guarantee around it).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .batch import as_float64
from .measure import gradients_of
from .rng import reseed
from .step import check_total, make_weights

# The smallest relative error between the difference quotient and autograd that each precision can
# tell apart from its arithmetic, with the steps below: what the report states as the check's
# resolution. In float32 a step large enough to rise above rounding crosses ReLU kinks and BatchNorm's
# batch statistics move with it: on the healthy models of the suite single directions were off by up
# to 15% (tests/test_gradcheck.py), so only a gap beyond 25% in every direction is a finding there.
DETECTABLE = {torch.float64: 1e-4, torch.float32: 0.25, torch.bfloat16: 0.5, torch.float16: 0.5}
# The relative step along a direction (each parameter moves by about this fraction of its own scale).
STEP = {torch.float64: 1e-6, torch.float32: 1e-3, torch.bfloat16: 3e-2, torch.float16: 3e-2}
DIRECTIONS = 3  # random directions per term and path; a term disagrees only when every one does
SMOOTH = 0.1  # step sizes h and 2h farther apart than this (relative): not smooth there
LOCALISE_LIMIT = 64  # groups at most per level of localisation


@dataclass
class Path:
    """A path as the check evaluates it: ``call(weights)`` returns the step's output for the model whose
    trainable parameters are ``params`` (the user's, or those of a float64 copy)."""

    name: str
    call: Callable[[Mapping[str, torch.Tensor]], Any]
    params: list[tuple[str, torch.Tensor]]
    buffers: list[torch.Tensor]
    on: str  # "the model" | "a float64 copy"
    note: str = ""


def term_value(out: Any, term: str, terms: Sequence[str]) -> torch.Tensor:
    """The term's value in a run where only ``term`` is switched on: its own value when the path
    returns it, else the total (the other terms weigh 0)."""
    total, values = check_total(out, terms)
    return values.get(term, total)


class _Evaluator:
    """Evaluations of one path, each from the same seeded RNG state and buffers, parameters moved
    through ``.data`` (their version counters stay) and put back exactly."""

    def __init__(self, path: Path, terms: Sequence[str], mode: str, seed: int) -> None:
        self.path, self.terms, self.mode, self.seed = path, terms, mode, seed
        self.tensors = [p for _, p in path.params]
        self.saved = [p.detach().clone() for p in self.tensors]
        self.saved_buffers = [b.detach().clone() for b in path.buffers]
        self.evaluations = 0

    def _reset(self) -> None:
        with torch.no_grad():
            for p, s in zip(self.tensors, self.saved, strict=True):
                p.data.copy_(s)
            for b, s in zip(self.path.buffers, self.saved_buffers, strict=True):
                b.data.copy_(s)

    def _run(self, term: str) -> torch.Tensor:
        reseed(self.seed)
        like = self.tensors[0]
        out = self.path.call(make_weights(self.terms, (term,), like))
        self.evaluations += 1
        return term_value(out, term, self.terms)

    def gradient(self, term: str) -> tuple[float, list[torch.Tensor | None]]:
        try:
            value = self._run(term)
            grads = gradients_of(value, self.tensors)
            return float(value.detach()), grads
        finally:
            self._reset()

    def value(self, term: str, direction: Sequence[torch.Tensor | None], step: float) -> float:
        try:
            with torch.no_grad():
                for p, d in zip(self.tensors, direction, strict=True):
                    if d is not None:
                        p.data.add_(d.to(p.dtype), alpha=step)
            with torch.enable_grad():  # a step may take gradients itself (forces)
                return float(self._run(term).detach())
        finally:
            self._reset()


def _directions(
    tensors: Sequence[torch.Tensor], count: int, seed: int, only: set[int] | None = None
) -> list[list[torch.Tensor | None]]:
    """``count`` random directions (float64), each tensor's part scaled by its own RMS (1 where it is
    zero), confined to the tensors ``only`` when given. Drawn from a private generator: the process's
    RNG streams are not touched."""
    out = []
    for k in range(count):
        gen = torch.Generator().manual_seed(seed * 1000 + k)
        direction: list[torch.Tensor | None] = []
        for i, p in enumerate(tensors):
            if only is not None and i not in only:
                direction.append(None)
                continue
            scale = p.detach().double().pow(2).mean().sqrt().item() if p.numel() else 0.0
            d = torch.randn(p.shape, generator=gen, dtype=torch.float64) * (scale or 1.0)
            direction.append(d.to(p.device))
        out.append(direction)
    return out


def _along(grads: Sequence[torch.Tensor | None], direction: Sequence[torch.Tensor | None]) -> float:
    total = 0.0
    for g, d in zip(grads, direction, strict=True):
        if g is not None and d is not None:
            total += float((g.detach().double() * d).sum())
    return total


def _compare(
    ev: _Evaluator,
    term: str,
    value: float,
    grads: Sequence[torch.Tensor | None],
    direction: Any,
    dtype: Any,
    floor: float = 0.0,
) -> dict[str, Any]:
    """One direction: the difference quotients at h and 2h against autograd's directional derivative;
    ``floor``: a gap the arithmetic is known to make along this direction (``calibrate``)."""
    h = STEP.get(dtype, 1e-3)
    plus, minus = ev.value(term, direction, h), ev.value(term, direction, -h)
    plus2, minus2 = ev.value(term, direction, 2 * h), ev.value(term, direction, -2 * h)
    fd, fd2 = (plus - minus) / (2 * h), (plus2 - minus2) / (4 * h)
    auto = _along(grads, direction)
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 1e-16
    rounding = 8 * eps * max(abs(plus), abs(minus), abs(value), 1e-300) / h
    scale = max(abs(fd), abs(auto))
    gap = abs(fd - auto)
    tolerance = max(4 * abs(fd - fd2), rounding, DETECTABLE.get(dtype, 1e-2) * scale, floor)
    finite = all(map(math.isfinite, (plus, minus, plus2, minus2, auto)))
    smooth = finite and abs(fd - fd2) <= SMOOTH * max(abs(fd), abs(fd2), rounding)
    return {
        "finite_difference": fd,
        "at_2h": fd2,
        "autograd": auto,
        "rel_error": gap / scale if scale > 0 else 0.0,
        "tolerance": tolerance,
        "verdict": "undecided" if not smooth else ("disagrees" if gap > tolerance else "agrees"),
    }


def _groups(names: Sequence[str], depth: int) -> dict[str, list[int]]:
    """Parameter indices by module prefix of ``depth`` components (a parameter's full name at most)."""
    out: dict[str, list[int]] = {}
    for i, n in enumerate(names):
        parts = n.split(".")
        out.setdefault(".".join(parts[: min(depth, len(parts))]), []).append(i)
    return out


def _localise(
    ev: _Evaluator, term: str, value: float, grads: Any, dtype: Any, seed: int, deadline: float
) -> tuple[list[str], dict[str, float], bool]:
    """The parameters along which the term's gradient disagrees with its finite differences: module by
    module, then within a disagreeing module tensor by tensor. Returns the disagreeing names, the
    relative error per group checked, and whether the budget ran out first."""
    names = [n for n, _ in ev.path.params]
    errors: dict[str, float] = {}
    suspects = list(range(len(names)))
    depth = 1
    while True:
        groups = _groups([names[i] for i in suspects], depth)
        if len(groups) > LOCALISE_LIMIT:
            return [names[i] for i in suspects], errors, False
        found: list[int] = []
        for prefix, members in groups.items():
            if time.perf_counter() > deadline:
                return [names[i] for i in suspects], errors, True
            idx = {suspects[j] for j in members}
            results = [
                _compare(ev, term, value, grads, d, dtype)
                for d in _directions(ev.tensors, 2, seed + depth, idx)
            ]
            errors[prefix] = max(r["rel_error"] for r in results)
            if all(r["verdict"] == "disagrees" for r in results):
                found.extend(sorted(idx))
        if not found:  # the disagreement needs several groups at once: leave it at the last level
            return [names[i] for i in suspects], errors, False
        suspects = found
        if all(len(names[i].split(".")) <= depth for i in suspects):
            return [names[i] for i in suspects], errors, False
        depth += 1


def _gaps(ev: _Evaluator, term: str, directions: Sequence[Any], dtype: Any) -> list[float]:
    """What the arithmetic alone makes of each direction: the gap between the difference quotient and
    autograd for the step as written, run on the model itself in its own dtype (the noise estimate of
    the paths checked in that dtype: a path gets its own gap as tolerance, three times over)."""
    value, grads = ev.gradient(term)
    return [
        3 * abs(r["finite_difference"] - r["autograd"])
        for r in (_compare(ev, term, value, grads, d, dtype) for d in directions)
    ]


def check_path(
    path: Path,
    terms: Sequence[str],
    mode: str,
    seed: int,
    deadline: float,
    calibration: _Evaluator | None = None,
) -> dict[str, Any]:
    """Every term of one path (see the module docstring). ``calibration``: the step as written on the
    model in its own dtype, whose gaps along the same directions widen this path's tolerance."""
    dtype = path.params[0][1].dtype
    out: dict[str, Any] = {
        "on": path.on,
        "dtype": str(dtype).removeprefix("torch."),
        "detectable": DETECTABLE.get(dtype, 1e-2),
        "note": path.note,
        "terms": {},
    }
    ev = _Evaluator(path, terms, mode, seed)
    for term in terms:
        start, used = time.perf_counter(), ev.evaluations
        entry: dict[str, Any] = {}
        out["terms"][term] = entry
        if time.perf_counter() > deadline:
            entry.update(status="not checked", reason="the check's time budget ran out")
            continue
        try:
            value, grads = ev.gradient(term)
            if not math.isfinite(value):
                entry.update(status="not checked", reason=f"the term's value is {value}")
                continue
            directions = _directions(ev.tensors, DIRECTIONS, seed)
            floors = [0.0] * len(directions)
            if calibration is not None:
                # The step as written may not run this term here: then no calibration.
                with contextlib.suppress(Exception):
                    floors = _gaps(calibration, term, directions, dtype)
            results = [
                _compare(ev, term, value, grads, d, dtype, f) for d, f in zip(directions, floors, strict=True)
            ]
            verdicts = {r["verdict"] for r in results}
            # A wrong backward is off along every random direction; a direction alone that disagrees is the
            # arithmetic (a ReLU or |x| kink crossed), not a finding.
            status = (
                "disagrees"
                if verdicts == {"disagrees"}
                else ("agrees" if verdicts == {"agrees"} else "undecided")
            )
            entry.update(status=status, rel_error=max(r["rel_error"] for r in results), directions=results)
            if status == "disagrees":
                parameters, groups, stopped = _localise(ev, term, value, grads, dtype, seed, deadline)
                entry.update(parameters=parameters, groups=groups, budget_reached=stopped)
        except Exception as e:  # the path cannot be evaluated or differentiated here: said, not raised
            text = str(e).strip().splitlines()
            entry.update(status="not checked", reason=f"{type(e).__name__}: {text[0][:200] if text else ''}")
        entry.update(evaluations=ev.evaluations - used, seconds=time.perf_counter() - start)
    return out


def gradients_check(
    paths: Sequence[Path],
    terms: Sequence[str],
    mode: str,
    seed: int,
    budget_s: float,
    calibration: Path | None = None,
) -> dict[str, Any]:
    """The check over every path, stopping at ``budget_s`` seconds (what was not reached says so).
    ``calibration``: the step as written on the model in its own dtype, the noise estimate of the paths
    checked on the model itself (the reference itself is checked on its float64 copy, uncalibrated)."""
    start = time.perf_counter()
    deadline = start + budget_s
    ev = _Evaluator(calibration, terms, mode, seed) if calibration is not None else None
    results = {
        p.name: check_path(
            p, terms, mode, seed, deadline, ev if p.on == "the model" and ev is not None else None
        )
        for p in paths
    }
    disagree = [
        (path, term)
        for path, r in results.items()
        for term, e in r["terms"].items()
        if e.get("status") == "disagrees"
    ]
    return {
        "budget_s": budget_s,
        "seconds": time.perf_counter() - start,
        "paths": results,
        "disagreements": [[p, t] for p, t in disagree],
    }


# ----- the paths of a probe -------------------------------------------------------------------------

BUDGET_S = 10.0  # at least; a probe whose steps are slow gets 20 steps' worth (see ``budget``)


def budget(step_seconds: float) -> float:
    """The check's time budget: ``BUDGET_S``, or twenty measured steps when those take longer."""
    return max(BUDGET_S, 20 * step_seconds)


def _trainable(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def reference_path(
    name: str,
    model: torch.nn.Module,
    weighted: Callable[[torch.nn.Module, Any, Mapping[str, torch.Tensor]], Any],
    batch: Any,
    terms: Sequence[str],
    mode: str,
    seed: int,
) -> Path:
    """The reference (the step as written, eager) on a float64 copy of the model where a copy can be made
    and runs every term; else on the model itself, in its own dtype, saying why."""
    own = Path(
        name, lambda w: weighted(model, batch, w), _trainable(model), list(model.buffers()), "the model"
    )
    if _trainable(model)[0][1].dtype == torch.float64:
        return own
    from .copies import model_copy

    try:
        copy = model_copy(model).double()
        batch64 = as_float64(batch)
        path = Path(
            name,
            lambda w: weighted(copy, batch64, w),
            _trainable(copy),
            list(copy.buffers()),
            "a float64 copy",
        )
        ev = _Evaluator(path, terms, mode, seed)
        for term in terms:  # the copy must run every term in float64, gradients included
            ev.gradient(term)
        return path
    except Exception as e:
        text = str(e).strip().splitlines()
        own.note = (
            f"a float64 copy could not run ({type(e).__name__}: {text[0][:160] if text else ''}): checked on "
            "the model itself in its own dtype"
        )
        return own
