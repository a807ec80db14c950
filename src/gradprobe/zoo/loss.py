"""The standard MLIP loss (energy, force, virial), one scalar per term."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class Prefactors:
    """Weights of the loss terms (DeePMD's ``start_pref_*``-style prefactors)."""

    energy: float = 1.0
    force: float = 10.0
    virial: float = 20.0  # the virial error is divided by natoms squared: a small prefactor drowns it


DEFAULT_PREFACTORS = Prefactors()


def mlip_loss(
    pred: dict[str, Tensor],
    batch: dict[str, Tensor],
    prefactors: Prefactors = DEFAULT_PREFACTORS,
    *,
    virial_per_atom: bool = True,
) -> dict[str, Tensor]:
    """Loss terms ``energy``, ``force`` and (when the batch has labels) ``virial``, prefactors applied.

    Energy and virial errors are divided by the number of atoms, so the terms do not grow with
    system size; the force term is the mean squared force-component error.
    """
    natoms = batch["atype"].shape[1]
    terms = {
        "energy": prefactors.energy * (((pred["energy"] - batch["energy"]) / natoms) ** 2).mean(),
        "force": prefactors.force * ((pred["force"] - batch["force"]) ** 2).mean(),
    }
    if "virial" in batch:
        # virial_per_atom=False is the norm-mismatch bug of gradprobe.zoo.bugs (a trainer that forgets it).
        scale = natoms if virial_per_atom else 1
        terms["virial"] = prefactors.virial * (((pred["virial"] - batch["virial"]) / scale) ** 2).mean()
    return terms
