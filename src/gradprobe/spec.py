"""The spec: everything gradprobe needs to know about what to probe, in one versioned dataclass.

Fields are keyword-only and every new field gets a default, so specs written against version 1 keep
working as the dataclass grows. ``gradprobe run FILE.py[:FUNCTION]`` calls a function returning one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .errors import SpecError
from .scenarios import Scenario

SPEC_VERSION = 1

StepMode = Literal["auto", "terms", "weights"]


@dataclass(frozen=True, kw_only=True)
class ProbeSpec:
    """What to probe.

    Args:
        model: the ``nn.Module``, or a zero-argument factory returning a fresh one.
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
        differentiable_inputs: batch keys that the probe clones and marks ``requires_grad_`` before each
            run (for steps that expect the caller to do it). The user's batch is never modified.
        notes: ``{parameter name or prefix: why it may legitimately get no gradient}``; shown in the
            report next to unreached parameters.
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
    differentiable_inputs: Sequence[str] = ()
    notes: Mapping[str, str] = field(default_factory=dict)
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

    def resolved_mode(self) -> Literal["terms", "weights"]:
        """The step contract in force: the explicit ``mode``, or inferred from the step's signature."""
        if self.mode != "auto":
            return self.mode
        return infer_mode(self.step)


def infer_mode(step: Callable[..., Any]) -> Literal["terms", "weights"]:
    """Two positional parameters: terms mode; three: weights mode."""
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


def resolve_model(spec: ProbeSpec) -> torch.nn.Module:
    """The spec's model, calling the factory if one was given."""
    model = spec.model
    if not isinstance(model, torch.nn.Module):
        if not callable(model):
            raise SpecError(f"model must be an nn.Module or a factory, got {type(model).__name__}")
        model = model()
        if not isinstance(model, torch.nn.Module):
            raise SpecError(f"the model factory returned {type(model).__name__}, not an nn.Module")
    return model
