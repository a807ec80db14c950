"""The step contract: calling the user's step and checking that what comes back is what was declared.

*Terms mode*: ``step(model, batch) -> {term: scalar tensor}``.
*Weights mode*: ``step(model, batch, weights) -> total`` or ``(total, {term: value})``, with
``weights`` a read-only mapping of term name to 0-dim tensor (never Python floats: floats specialise
a compiled graph and recompile per scenario).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from .errors import StepContractError, did_you_mean


class Weights(Mapping[str, torch.Tensor]):
    """Per-term weights handed to a weights-mode step. Asking for an unknown term is a clear error."""

    def __init__(self, values: Mapping[str, torch.Tensor]) -> None:
        self._values = dict(values)

    def __getitem__(self, key: str) -> torch.Tensor:
        try:
            return self._values[key]
        except KeyError:
            raise StepContractError(
                f"the step asked for the weight of unknown term {key!r}{did_you_mean(key, self._values)}; "
                f"terms are: {', '.join(self._values)} (declare every term the step weighs in terms=)"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Weights({ {k: float(v) for k, v in self._values.items()} })"


def make_weights(terms: Sequence[str], on: Sequence[str], like: torch.Tensor) -> Weights:
    """1 for the terms in ``on``, 0 for the others, as 0-dim tensors of ``like``'s dtype and device."""
    dtype = like.dtype if like.is_floating_point() else torch.get_default_dtype()
    return Weights({t: torch.tensor(1.0 if t in on else 0.0, dtype=dtype, device=like.device) for t in terms})


def check_scalar(value: Any, what: str) -> torch.Tensor:
    """``value`` as a one-element tensor, or a StepContractError naming ``what``."""
    if not isinstance(value, torch.Tensor):
        raise StepContractError(f"{what} must be a torch.Tensor, got {type(value).__name__}")
    if value.numel() != 1:
        raise StepContractError(
            f"{what} must be a scalar (one element), got shape {tuple(value.shape)}: reduce it "
            "(e.g. .mean() or .sum()) inside the step"
        )
    return value


def check_terms(out: Any, declared: Sequence[str] | None) -> dict[str, torch.Tensor]:
    """Validate a terms-mode step's output: a dict of scalar tensors with the declared names."""
    if not isinstance(out, Mapping):
        raise StepContractError(
            f"a terms-mode step must return a dict {{term name: scalar tensor}}, got {type(out).__name__}; "
            "a step that returns the total loss and takes per-term weights is a weights-mode step "
            "(step(model, batch, weights), mode='weights')"
        )
    if not out:
        raise StepContractError("the step returned an empty dict: it must return at least one term")
    names = [str(k) for k in out]
    if declared is not None:
        missing = [t for t in declared if t not in out]
        extra = [n for n in names if n not in declared]
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing {missing}")
            if extra:
                parts.append(f"undeclared {extra}")
            raise StepContractError(
                f"the step's terms do not match the declared terms {list(declared)}: {'; '.join(parts)}"
            )
    return {str(k): check_scalar(v, f"term {str(k)!r}") for k, v in out.items()}


def metrics_of(out: Any) -> dict[str, Any]:
    """The metrics a step reports beside its loss: the third item of ``(total, {term: value},
    {metric: value})`` (a trainer's rmse, say: recorded per run, compared between paths, not trained)."""
    if isinstance(out, tuple) and len(out) == 3 and isinstance(out[2], Mapping):
        return {str(k): v for k, v in out[2].items()}
    return {}


def check_total(out: Any, terms: Sequence[str]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Validate a weights-mode step's output: ``total``, ``(total, {term: value})`` or
    ``(total, {term: value}, {metric: value})`` (metrics: see ``metrics_of``)."""
    values: dict[str, torch.Tensor] = {}
    if (
        isinstance(out, tuple)
        and len(out) == 3
        and isinstance(out[1], Mapping)
        and isinstance(out[2], Mapping)
    ):
        out = out[:2]
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
        out, raw = out
        for k, v in raw.items():
            if str(k) not in terms:
                raise StepContractError(
                    f"the step reported undeclared term {k!r}; terms are: {', '.join(terms)}"
                )
            values[str(k)] = check_scalar(v, f"term {str(k)!r}")
    if isinstance(out, Mapping):
        raise StepContractError(
            "a weights-mode step must return the total loss (a scalar tensor), got a dict: a step that "
            "returns {term: value} is a terms-mode step (step(model, batch), mode='terms')"
        )
    return check_scalar(out, "the total loss returned by the step"), values
