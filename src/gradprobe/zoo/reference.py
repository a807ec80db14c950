"""The reference potential's probe spec: model factory, synthetic batches, the MLIP training step."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import torch

from ..errors import SpecError, did_you_mean
from ..spec import ProbeSpec
from .data import make_batch
from .loss import DEFAULT_PREFACTORS, Prefactors, mlip_loss
from .potential import ReferencePotential

# Why some parameters legitimately get no gradient from some terms (shown next to the counts).
REFERENCE_NOTES = {
    "aux_head": "auxiliary head: used by no loss term, by design",
    "energy_shift": "constant per-type energy: no force/virial gradient, by construction",
    "fitting.out.bias": "constant added to every atomic energy: no force/virial gradient, by construction",
}


def terms_step(
    model: ReferencePotential, batch: dict[str, torch.Tensor], *, prefactors: Prefactors = DEFAULT_PREFACTORS
) -> dict[str, torch.Tensor]:
    """Terms mode: predict energy, forces, virial; return the weighted loss terms."""
    pred = model(batch["coord"], batch["atype"], batch["box"])
    return mlip_loss(pred, batch, prefactors)


def weights_step(
    model: ReferencePotential,
    batch: dict[str, torch.Tensor],
    weights: dict[str, torch.Tensor],
    *,
    prefactors: Prefactors = DEFAULT_PREFACTORS,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weights mode: the total loss with per-term weights (and the term values, for the report)."""
    terms = terms_step(model, batch, prefactors=prefactors)
    total = torch.stack([weights[name] * value for name, value in terms.items()]).sum()
    return total, terms


def conflict_step(model: ReferencePotential, batch: dict[str, torch.Tensor], *,
                  prefactors: Prefactors = DEFAULT_PREFACTORS) -> dict[str, torch.Tensor]:  # fmt: skip
    """The terms-conflict bug: two energy terms whose reference energies disagree by 4 eV/atom."""
    pred = model(batch["coord"], batch["atype"], batch["box"])
    terms = mlip_loss(pred, batch, prefactors)
    natoms = batch["atype"].shape[1]
    shift = 2.0 * natoms
    for name, sign in (("energy", -1.0), ("energy_b", 1.0)):
        terms[name] = (
            prefactors.energy * (((pred["energy"] - batch["energy"] - sign * shift) / natoms) ** 2).mean()
        )
    return {k: terms[k] for k in ("energy", "energy_b", "force", "virial") if k in terms}


def _optimizer(kind: str | None) -> Any:
    """The optimizer factory the "user" trains with (the not-in-optimizer and zero-lr bugs)."""
    if kind == "filter":
        return lambda model: torch.optim.Adam(
            [p for n, p in model.named_parameters() if not n.startswith("fitting.layer2")], lr=1e-3
        )
    if kind == "lr0":

        def two_groups(model: torch.nn.Module) -> torch.optim.Optimizer:
            fitting = [p for n, p in model.named_parameters() if n.startswith("fitting.")]
            rest = [p for n, p in model.named_parameters() if not n.startswith("fitting.")]
            return torch.optim.Adam([{"params": fitting, "lr": 0.0}, {"params": rest}], lr=1e-3)

        return two_groups
    return lambda params: torch.optim.Adam(params, lr=1e-3)


def reference_energy(model: ReferencePotential, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Energies as a plain function of the batch's coordinates and cells (for physics checks)."""
    return model.energy(batch["coord"], batch["atype"], batch["box"])


def reference_predict(model: ReferencePotential, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's own energy, forces and virial (what the physics checks test)."""
    return model(batch["coord"], batch["atype"], batch["box"])


def reference_spec(
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float64,
    mode: Literal["terms", "weights"] = "terms",
    with_virial: bool = True,
    seed: int = 0,
    nframes: int = 2,
    natoms: int = 8,
    prefactors: Prefactors = DEFAULT_PREFACTORS,
    bug: str | None = None,
) -> ProbeSpec:
    """A spec for the reference potential on synthetic periodic frames (terms energy, force, virial).

    ``bug`` injects one known bug from ``gradprobe.zoo.bugs.BUGS`` (the spec then also names the
    execution paths the "user" trains with); the detectors are never told which.
    """
    from .bugs import BUGS, register_lossy_backend, register_norm_trainer

    if bug is not None and bug not in BUGS:
        raise SpecError(f"unknown zoo bug {bug!r}{did_you_mean(bug, BUGS)}; bugs are: {', '.join(BUGS)}")
    injected = BUGS[bug] if bug is not None else None
    if injected is not None and injected.model_family == "multitask":
        from .multitask import multitask_spec

        return multitask_spec(flags=True, dtype=dtype, device=device, variants=injected.variants, seed=seed)
    switches = dict(injected.model or {}) if injected else {}
    if injected is not None and injected.id == "backend-drops-grads":
        register_lossy_backend()
    if injected is not None and injected.id == "norm-mismatch":
        register_norm_trainer()
    mode = injected.mode if injected is not None and injected.mode != "terms" else mode

    def factory() -> ReferencePotential:
        # Deterministic weights without touching the caller's global RNG stream.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = ReferencePotential(**switches)
        return model.to(device=device, dtype=dtype).train(not (injected is not None and injected.eval_model))

    batches = [
        make_batch(nframes, natoms, seed=seed + k, dtype=dtype, device=device, with_virial=with_virial)
        for k in (0, 1)
    ]
    other = make_batch(
        nframes + 1, natoms + 2, seed=seed + 2, dtype=dtype, device=device, with_virial=with_virial
    )
    terms = ["energy", "force", "virial"] if with_virial else ["energy", "force"]
    if injected is not None and injected.conflict:
        terms.insert(1, "energy_b")
    if injected is not None and injected.prefactors:
        prefactors = dataclasses.replace(prefactors, **injected.prefactors)
    terms_fn = conflict_step if injected is not None and injected.conflict else terms_step
    step: Any = functools.partial(terms_fn if mode == "terms" else weights_step, prefactors=prefactors)
    return ProbeSpec(
        model=factory,
        step=step,
        batch=batches[0],
        second_batch=batches[1],
        other_shapes_batch=other,
        terms=terms,
        mode=mode,
        optimizer=_optimizer(injected.optimizer if injected is not None else None),
        clip_grad_norm=injected.clip_grad_norm if injected is not None else None,
        energy_fn=reference_energy,
        predict=reference_predict,
        notes=REFERENCE_NOTES,
        seed=seed,
        variants=injected.variants if injected is not None else None,
        name="reference potential" + (f" with bug {bug}" if bug else ""),
    )
