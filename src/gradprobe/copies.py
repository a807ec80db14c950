"""Copies of the user's model for the checks that step or convert one (training, balance, physics):
the user's model is never stepped, converted or handed to an optimizer factory while a copy can be
made.

* ``model_copy``: a deep copy. A model that ran a forward often holds tensors computed from its
  parameters in plain attributes, directly or in a dict or list (a cached activation, old-style
  ``spectral_norm``/``weight_norm``'s computed ``weight``, matgl's ``feature_dict``), which ``deepcopy``
  refuses ("Only Tensors created explicitly by the user (graph leaves) support the deepcopy
  protocol"): the copy gets their values, detached. What still cannot be copied (a lock, a process
  pool, an open file) raises ``CopyError`` naming the attribute.
* ``working_model``: the copy a check works on, or, where none can be made, the model itself under
  the state guarantee (its parameters, buffers and attributes put back when the check ends), with a
  note that names the attribute.
* ``meta_twin``: the model's structure with every parameter and buffer on the meta device (no memory,
  no values), for code that only needs names, shapes and identities: an optimizer factory builds its
  groups on it, so hooks it registers land on the twin, never on the user's parameters.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch


class CopyError(RuntimeError):
    """The model cannot be deep-copied; the message names the attribute that refuses."""


# How deep the search for computed tensors goes into an attribute's dicts, lists and tuples.
_DEPTH = 4


def _computed_tensors(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """``deepcopy`` memo entries: each non-leaf tensor a module holds in a plain attribute, directly or
    in dicts, lists and tuples, as a detached copy."""
    memo: dict[int, Any] = {}

    def visit(v: Any, depth: int) -> None:
        if isinstance(v, torch.Tensor):
            if not v.is_leaf and id(v) not in memo:
                memo[id(v)] = v.detach().clone()
        elif depth < _DEPTH and isinstance(v, dict):
            for x in v.values():
                visit(x, depth + 1)
        elif depth < _DEPTH and isinstance(v, list | tuple):
            for x in v:
                visit(x, depth + 1)

    for m in model.modules():
        for key, v in vars(m).items():
            if key != "_modules":
                visit(v, 0)
    return memo


def model_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model``; tensors it computed and keeps in attributes are copied detached."""
    memo = _computed_tensors(model)
    try:
        return copy.deepcopy(model, dict(memo))  # deepcopy fills its memo: _why_not needs it as it was
    except Exception as e:
        raise CopyError(f"the model cannot be deep-copied: {_why_not(model, memo, e)}") from e


def _why_not(model: torch.nn.Module, memo: dict[int, Any], error: Exception) -> str:
    """The first attribute that refuses a deep copy, by module name (found only after a failure)."""
    text = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
    cause = f"{type(error).__name__}: {text}"
    for name, m in model.named_modules():
        for attr, v in vars(m).items():
            if attr in ("_parameters", "_buffers", "_modules"):
                continue
            try:
                copy.deepcopy(v, dict(memo))
            except Exception:
                where = f"module {name!r}" if name else "the root module"
                return (
                    f"attribute {attr!r} of {where} ({type(m).__name__}) holds a {type(v).__name__} ({cause})"
                )
    return f"({cause})"


@contextlib.contextmanager
def working_model(model: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, str | None]]:
    """``(copy, None)``; where no copy can be made, ``(model, note)``: the model itself, its state
    (parameters and their ``.grad``, buffers, attributes, modes) put back when the body ends, and a
    note that says why, naming the attribute."""
    try:
        copied = model_copy(model)
    except CopyError as e:
        from .model_state import restore_model, snapshot_model

        state = snapshot_model(model)
        try:
            yield model, f"{e}; run on the model itself, whose state is put back after"
        finally:
            restore_model(state)
        return
    yield copied, None


def meta_twin(model: torch.nn.Module) -> torch.nn.Module:
    """The model's module tree, each module a shallow copy with meta-device parameters and buffers of
    the same shapes, dtypes and ``requires_grad`` (tied ones stay tied) and its own hook dicts and
    other containers; other attributes are shared, read only. Costs the Python structure only, and
    never fails on attributes that refuse a deep copy."""
    tensors: dict[int, Any] = {}
    twins: dict[int, torch.nn.Module] = {}

    def meta(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in tensors:
            m = torch.empty_like(t, device="meta")
            tensors[id(t)] = (
                torch.nn.Parameter(m, t.requires_grad) if isinstance(t, torch.nn.Parameter) else m
            )
        return tensors[id(t)]

    def twin(module: torch.nn.Module) -> torch.nn.Module:
        if id(module) in twins:
            return twins[id(module)]
        t = copy.copy(module)  # a new __dict__ holding the same values
        twins[id(module)] = t
        for key, value in list(vars(t).items()):
            if isinstance(value, dict | list | set):  # hooks, _non_persistent_buffers_set, ...
                t.__dict__[key] = copy.copy(value)
            elif isinstance(value, torch.Tensor):  # old-style weight_norm's computed weight
                t.__dict__[key] = meta(value)
        t.__dict__["_parameters"] = {k: None if p is None else meta(p) for k, p in module._parameters.items()}
        t.__dict__["_buffers"] = {k: None if b is None else meta(b) for k, b in module._buffers.items()}
        t.__dict__["_modules"] = {k: None if c is None else twin(c) for k, c in module._modules.items()}
        return t

    return twin(model)
