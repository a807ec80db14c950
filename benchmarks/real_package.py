"""A model from a package we did not write, for the diagnose-time section: SchNetPack 2.1.

A tiny SchNet potential (8 features, one interaction) on one random periodic frame of 5 atoms,
neighbours from SchNetPack's own ASE list; energy, force and stress terms, as tests/test_real_schnetpack.py
builds it. No download. ``schnetpack_case_parts()`` is None when SchNetPack is not installed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch

TERMS = ["energy", "force", "stress"]


def available() -> bool:
    return importlib.util.find_spec("schnetpack") is not None


def _import_schnetpack() -> Any:
    # torch 2.13 renamed torch.utils.data.dataloader.T_co to _T_co; SchNetPack 2.1 still imports the
    # old name. The alias is the benchmark's workaround (the package is not patched).
    import torch.utils.data.dataloader as dataloader

    if not hasattr(dataloader, "T_co"):
        dataloader.T_co = dataloader._T_co  # type: ignore[attr-defined]
    import schnetpack

    return schnetpack


def _system(seed: int = 0, n: int = 5) -> dict[str, torch.Tensor]:
    from ase import Atoms
    from schnetpack.interfaces import AtomsConverter
    from schnetpack.transform import ASENeighborList

    g = torch.Generator().manual_seed(seed)
    pos = torch.rand(n, 3, generator=g, dtype=torch.float64) * 3.0
    atoms = Atoms(numbers=[1, 8] * (n // 2) + [1] * (n % 2), positions=pos.numpy(), cell=[3.0] * 3, pbc=True)
    batch = AtomsConverter(neighbor_list=ASENeighborList(cutoff=2.5), dtype=torch.float64)(atoms)
    batch["energy"] = torch.randn(1, generator=g, dtype=torch.float64)
    batch["forces"] = torch.randn(n, 3, generator=g, dtype=torch.float64)
    batch["stress"] = torch.randn(1, 3, 3, generator=g, dtype=torch.float64)
    return batch


def _model(spk: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    representation = spk.representation.SchNet(
        n_atom_basis=8, n_interactions=1, radial_basis=spk.nn.GaussianRBF(n_rbf=6, cutoff=2.5),
        cutoff_fn=spk.nn.CosineCutoff(2.5),
    )  # fmt: skip
    return spk.model.NeuralNetworkPotential(
        representation=representation,
        input_modules=[spk.atomistic.Strain(), spk.atomistic.PairwiseDistances()],
        output_modules=[
            spk.atomistic.Atomwise(n_in=8, output_key="energy"),
            spk.atomistic.Forces(
                calc_stress=True, energy_key="energy", force_key="forces", stress_key="stress"
            ),
        ],
        postprocessors=[],
    ).double()


def schnetpack_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = model(dict(batch))
    return {"energy": (out["energy"] - batch["energy"]).pow(2).mean(),
            "force": (out["forces"] - batch["forces"]).pow(2).mean(),
            "stress": (out["stress"] - batch["stress"]).pow(2).mean()}  # fmt: skip


def schnetpack_case_parts() -> tuple[torch.nn.Module, Callable[..., Any], Any, Any, list[str]] | None:
    """(model, step, batch, second batch, terms), or None without SchNetPack."""
    if not available():
        return None
    spk = _import_schnetpack()
    return _model(spk), schnetpack_step, _system(0), _system(1), list(TERMS)
