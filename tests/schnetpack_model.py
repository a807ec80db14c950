"""SchNetPack 2.1 for tests/test_real_schnetpack.py: a tiny SchNet potential (8 features, one
interaction) on one random periodic frame of 5 atoms, neighbours from SchNetPack's own ASE list; energy,
force and stress terms. No download. Import it only where SchNetPack is installed."""

from __future__ import annotations

from typing import Any

import torch


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
