"""The spec: everything gradprobe needs to know about what to probe, in one versioned dataclass.

Fields are keyword-only and every new field gets a default, so specs written against version 1 keep
working as the dataclass grows. ``gradprobe run FILE.py[:FUNCTION]`` calls a function returning one.
"""

from __future__ import annotations

import inspect
import math
import types
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.nn.parameter import is_lazy

from .errors import SpecError
from .scenarios import Scenario

SPEC_VERSION = 1

StepMode = Literal["auto", "terms", "weights"]


@dataclass(frozen=True, kw_only=True)
class ProbeSpec:
    """What to probe.

    Args:
        model: the ``nn.Module``, or a zero-argument factory returning a fresh one (called with every RNG
            seeded by ``seed``, so its initial weights are the same in every process; the caller's RNG
            state is left as it was).
        step: the training step. *Terms mode*: ``step(model, batch) -> dict[str, Tensor]`` of named
            scalar loss terms. *Weights mode*: ``step(model, batch, weights) -> Tensor`` (the total
            loss), where ``weights`` maps each term name to a 0-dim tensor; it may also return
            ``(total, {term: value})`` so the report shows term values.
        batch: the inputs the step is called with (any object; a dict of tensors is typical).
        terms: the term names. Required in weights mode; in terms mode taken from the step's output
            when omitted.
        mode: ``"terms"``, ``"weights"`` or ``"auto"`` (from the step's number of parameters).
        scenarios: ``{name: [terms]}`` or ``Scenario`` objects; default: each term alone plus "all".
        second_batch: a batch of the same shapes and other values (catches traced graphs that froze
            trace-time tensors).
        other_shapes_batch: a batch of other shapes (catches graphs locked onto the first shapes).
        optimizer: an optimizer, or a factory ``params -> optimizer``, for training checks and the
            optimizer audit (never stepped: checks use fresh ones on copies).
        clip_grad_norm: the ``max_norm`` the user clips gradients to, if any (balance check).
        energy_fn: ``energy_fn(model, batch) -> energies`` (one per frame), a plain function of the
            batch's coordinates (``batch[coord_key]``) and cell (``batch[box_key]``), for physics checks.
        predict: ``predict(model, batch) -> {"force": ..., "virial": ...}``, the model's own forces
            (and virial), checked against finite differences of ``energy_fn``.
        coord_key, box_key: where the coordinates ``(nframes, natoms, 3)`` and cells ``(nframes, 3, 3)``
            are in a dict batch (``box_key=None``: not periodic, no virial check).
        geometry: where the atoms are in any other batch, for the physics check: a
            ``gradprobe.geometry.Geometry`` (positions ``(atoms, 3)`` by path in a PyG ``Data``/``Batch``,
            a dict or a tuple, the per-atom frame index, Cartesian or fractional, the cells);
            ``gradprobe.adapters.potential`` builds one. Replaces ``coord_key``/``box_key``.
        differentiable_inputs: batch keys that the probe clones and marks ``requires_grad_`` before each
            run (for steps that expect the caller to do it). The user's batch is never modified.
        notes: ``{parameter name or prefix: why it may legitimately get no gradient}``; shown in the
            report next to unreached parameters, and a cut they cover is information, not an error.
        expect: what each scenario must reach: ``{"force only": ["fitting."]}`` (parameter names or
            module prefixes that must get a non-zero gradient), or ``{scenario: {"reaches": [...],
            "not_reaches": [...]}}``. A broken declaration is an ``expectation-unmet`` error naming the
            parameters and, with ``diagnose=True``, where the gradient stops. One mechanism with
            ``notes`` (declarations.py).
        prefactor_schedule: for a trainer whose loss prefactors follow a schedule (DeePMD's move from
            ``start_pref_*`` to ``limit_pref_*`` with the learning rate): ``{"now": {term: prefactor},
            "limit": {term: prefactor}, "step": "what 'now' is"}``. The balance check is taken at the
            step's prefactors ("now") and says whether a drowned term is still drowned at the limit.
        seed: the RNG seed set before every run, so stochastic ops draw the same in every run.
        variants: the execution paths this spec trains with (e.g. ``"eager,make_fx+compile:inductor"``);
            used when ``probe()`` is given none.
        name: a label for reports.
        version: the spec format version this spec was written for.
    """

    model: torch.nn.Module | Callable[[], torch.nn.Module]
    step: Callable[..., Any]
    batch: Any
    terms: Sequence[str] | None = None
    mode: StepMode = "auto"
    scenarios: Mapping[str, Sequence[str]] | Sequence[Scenario] | None = None
    second_batch: Any = None
    other_shapes_batch: Any = None
    optimizer: Any = None
    clip_grad_norm: float | None = None
    energy_fn: Callable[..., torch.Tensor] | None = None
    predict: Callable[..., Mapping[str, torch.Tensor]] | None = None
    coord_key: str = "coord"
    box_key: str | None = "box"
    geometry: Any = None
    differentiable_inputs: Sequence[str] = ()
    notes: Mapping[str, str] = field(default_factory=dict)
    expect: Mapping[str, Any] | None = None
    prefactor_schedule: Mapping[str, Any] | None = None
    seed: int = 0
    variants: str | Sequence[str] | None = None
    name: str = ""
    version: int = SPEC_VERSION

    def __post_init__(self) -> None:
        if self.version > SPEC_VERSION:
            raise SpecError(
                f"this spec was written for spec version {self.version}, but this gradprobe reads "
                f"version {SPEC_VERSION} at most: upgrade gradprobe (pip install -U gradprobe)"
            )
        if not callable(self.step):
            raise SpecError(f"step must be callable, got {type(self.step).__name__}")
        if self.mode not in ("auto", "terms", "weights"):
            raise SpecError(f"mode must be 'auto', 'terms' or 'weights', got {self.mode!r}")
        if self.terms is not None:
            if isinstance(self.terms, str):
                raise SpecError(f"terms must be a list of names, got the string {self.terms!r}")
            names = list(self.terms)
            if len(set(names)) != len(names) or not names:
                raise SpecError(f"terms must be non-empty and unique, got {names}")
        _check_fields(self)

    def resolved_mode(self) -> Literal["terms", "weights"]:
        """The step contract in force: the explicit ``mode``, or inferred from the step's signature."""
        if self.mode != "auto":
            return self.mode
        return infer_mode(self.step)


SEED_MAX = 2**64 - 1  # torch.manual_seed takes an unsigned 64-bit seed


def _shown(x: Any) -> str:
    return f"the string {x!r}" if isinstance(x, str) else f"{x!r} ({type(x).__name__})"


def _check_fields(spec: ProbeSpec) -> None:
    """Fields of the wrong type fail here, with the fix, instead of deep inside a probe."""
    seed = spec.seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise SpecError(f"seed must be an integer from 0 to 2**64 - 1, got {_shown(seed)}")
    if not isinstance(spec.notes, Mapping):
        example = {str(spec.notes[0]): "why"} if isinstance(spec.notes, list | tuple) and spec.notes else {}
        raise SpecError(
            f"notes must be a mapping {{parameter name or prefix: why it may get no gradient}}, got "
            f"{_shown(spec.notes)}; e.g. notes={example or {'aux_head': 'unused by design'}}"
        )
    from .declarations import normalized_expect

    normalized_expect(spec.expect)  # a wrong shape fails here, with the accepted forms
    clip = spec.clip_grad_norm
    if clip is not None and (
        isinstance(clip, bool) or not isinstance(clip, int | float) or not math.isfinite(clip) or clip <= 0
    ):
        raise SpecError(
            f"clip_grad_norm must be a positive number (the max_norm given to clip_grad_norm_), got {_shown(clip)}"
        )
    opt = spec.optimizer
    if opt is not None and not isinstance(opt, torch.optim.Optimizer) and not callable(opt):
        raise SpecError(
            f"optimizer must be a torch.optim.Optimizer or a factory params -> optimizer, got {_shown(opt)}; "
            "e.g. optimizer=lambda params: torch.optim.Adam(params, lr=1e-3)"
        )
    keys = spec.differentiable_inputs
    if isinstance(keys, str) or not isinstance(keys, Sequence | set | frozenset):
        raise SpecError(
            f"differentiable_inputs must be a list of batch keys, got {_shown(keys)}; e.g. "
            f"differentiable_inputs={[keys] if isinstance(keys, str) else ['coord']}"
        )


# Steps whose mode was read, by identity (inspect.signature costs tens of microseconds a probe).
_MODES: weakref.WeakKeyDictionary[Any, Literal["terms", "weights"]] = weakref.WeakKeyDictionary()


def infer_mode(step: Callable[..., Any]) -> Literal["terms", "weights"]:
    """Two positional parameters: terms mode; three: weights mode."""
    if isinstance(step, types.FunctionType):  # hashed by identity; a signature read once per function
        mode = _MODES.get(step)
        if mode is None:
            mode = _MODES[step] = _mode_of(step)
        return mode
    return _mode_of(step)


def _mode_of(step: Callable[..., Any]) -> Literal["terms", "weights"]:
    try:
        params = inspect.signature(step).parameters.values()
    except (TypeError, ValueError) as e:
        raise SpecError("cannot read the step's signature: set mode='terms' or mode='weights'") from e
    positional = [
        p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        raise SpecError("the step takes *args, so its contract is ambiguous: set mode='terms' or 'weights'")
    if len(positional) == 2:
        return "terms"
    if len(positional) == 3:
        return "weights"
    raise SpecError(
        f"the step takes {len(positional)} required positional parameters; expected 2 "
        "(model, batch) for terms mode or 3 (model, batch, weights) for weights mode, or set mode="
    )


def resolve_model(spec: ProbeSpec, check: bool = True) -> torch.nn.Module:
    """The spec's model, calling the factory if one was given; a model without values (the meta
    device, uninitialized lazy modules) is refused (``check=False``: the caller runs ``check_values``
    on the parameters it lists anyway)."""
    model = spec.model
    if not isinstance(model, torch.nn.Module):
        if not callable(model):
            raise SpecError(f"model must be an nn.Module or a factory, got {type(model).__name__}")
        try:
            model = _built_seeded(model, spec.seed)
        except Exception as e:
            if isinstance(spec.model, type):
                raise SpecError(
                    f"model is the class {spec.model.__name__}, not an instance: pass "
                    f"{spec.model.__name__}(...) (a class is called as a zero-argument factory, and "
                    f"{spec.model.__name__}() raised {type(e).__name__}: {e})"
                ) from e
            raise SpecError(
                f"the model factory raised {type(e).__name__}: {e} (the factory is called with no arguments "
                "and must return the nn.Module to probe)"
            ) from e
        if not isinstance(model, torch.nn.Module):
            raise SpecError(f"the model factory returned {type(model).__name__}, not an nn.Module")
    if check:
        check_values(model, list(model.named_parameters()))
    return model


def _built_seeded(factory: Callable[[], Any], seed: int) -> Any:
    """``factory()`` with every RNG seeded by ``spec.seed`` (its initial weights are the same in every
    process: torch's default seed differs per process, so snapshots of a factory's model never matched),
    and the caller's RNG streams as they were afterwards."""
    from .rng import kept_rng

    with kept_rng(seed):
        return factory()


def check_values(
    model: torch.nn.Module,
    named: list[tuple[str, torch.nn.Parameter]],
    buffers: list[tuple[str, torch.Tensor]] | None = None,
) -> None:
    """Every parameter (``named``: the model's, listed once by the caller) and buffer (``buffers``:
    ``named_buffers()`` when the caller has listed them) has values."""
    tensors = [*named, *(model.named_buffers() if buffers is None else buffers)]
    # Only tensors of another type (lazy, fake) or on the meta device can lack values.
    for name, t in tensors:
        if type(t) in (torch.Tensor, torch.nn.Parameter) and not t.is_meta:
            continue
        from torch._subclasses.fake_tensor import is_fake

        if is_lazy(t):
            owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            raise SpecError(
                f"{name} is uninitialized ({type(owner).__name__} infers its shape on its first call): run "
                "one forward on a batch before probing, e.g. model(batch), so that it has parameters"
            )
        if is_fake(t):
            raise SpecError(
                f"{name} is a FakeTensor (made under FakeTensorMode or by a tracer): it has a shape but no "
                "values, so no gradient can be measured. Probe the real model, built outside FakeTensorMode"
            )
        if t.is_meta:
            raise SpecError(
                f"{name} is on the meta device: it has a shape but no values. Materialize the model first "
                "(model.to_empty(device='cpu') and load_state_dict(...), or build it on a real device)"
            )
