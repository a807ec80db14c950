"""A tiny graph potential written the way MLIP packages write theirs (issue 33), for the generic
potential adapter's tests without any MLIP package: periodic frames batched as one graph (positions
``(atoms, 3)``, a per-atom frame index ``batch``, cells ``(frames, 3, 3)``, an edge list with periodic
shifts), energies per frame, forces and stress (ASE convention) by ``autograd.grad`` inside.

Switches reproduce what the real packages do: ``float32_inside`` casts to float32 inside (SevenNet's
embedding: a float64 copy of the model fails), ``cache`` keeps computed tensors in a dict attribute
(matgl's ``feature_dict``), ``precomputed_edges`` reads edge vectors computed with the batch (SevenNet's
``edge_vec``), ``own_forces=False`` returns the energy only (forces by autograd outside). Faults:
``scale_forces`` (forces not -dE/dx) and ``detach_forces`` (forces without ``create_graph``).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from torch import nn


class Graph:
    """A minimal graph batch: attributes, a ``keys()`` like PyG's ``Data``, shallow-copyable."""

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)

    def keys(self) -> list[str]:
        return list(self.__dict__)


def graph_batch(
    *, frames: int = 2, atoms: int = 5, box: float = 3.0, cutoff: float = 2.5, dtype: torch.dtype = torch.float64,
    seed: int = 0, as_dict: bool = False,
) -> Any:  # fmt: skip
    """Random periodic frames (two species) as one graph, with the neighbour list (periodic images by
    brute force) and random energy, force and stress labels."""
    g = torch.Generator().manual_seed(seed)
    pos, frame, species, src, dst, shift, cells = [], [], [], [], [], [], []
    for f in range(frames):
        p = torch.rand(atoms, 3, generator=g, dtype=torch.float64) * box
        cell = torch.eye(3, dtype=torch.float64) * box + 0.1 * torch.rand(
            3, 3, generator=g, dtype=torch.float64
        )
        base = f * atoms
        for i, j in itertools.product(range(atoms), repeat=2):
            for s in itertools.product((-1, 0, 1), repeat=3):
                if i == j and s == (0, 0, 0):
                    continue
                d = p[j] - p[i] + torch.tensor(s, dtype=torch.float64) @ cell
                if float(d.norm()) < cutoff:
                    src.append(base + i)
                    dst.append(base + j)
                    shift.append(s)
        pos.append(p)
        cells.append(cell)
        frame += [f] * atoms
        species += [k % 2 for k in range(atoms)]
    values = {
        "pos": torch.cat(pos).to(dtype),
        "batch": torch.tensor(frame),
        "species": torch.tensor(species),
        "cell": torch.stack(cells).to(dtype),
        "edge_index": torch.tensor([src, dst]),
        "shift": torch.tensor(shift, dtype=dtype),
        "energy_label": torch.randn(frames, generator=g, dtype=torch.float64).to(dtype),
        "force_label": torch.randn(frames * atoms, 3, generator=g, dtype=torch.float64).to(dtype),
        "stress_label": 0.1 * torch.randn(frames, 3, 3, generator=g, dtype=torch.float64).to(dtype),
    }
    i, j = values["edge_index"]
    frame_t = values["batch"]
    values["edge_vec"] = (
        values["pos"][j]
        - values["pos"][i]
        + (values["shift"].unsqueeze(-2) @ values["cell"][frame_t[i]]).squeeze(-2)
    )
    return values if as_dict else Graph(**values)


class PairPotential(nn.Module):
    """E = sum over edges of an MLP of the distance and both species, cut off smoothly at ``cutoff``."""

    def __init__(
        self, *, cutoff: float = 2.5, float32_inside: bool = False, cache: bool = False,
        precomputed_edges: bool = False, own_forces: bool = True, scale_forces: float = 1.0,
        detach_forces: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.cutoff = cutoff
        self.species = nn.Embedding(2, 4)
        self.radial = nn.Linear(6, 8)
        self.out = nn.Sequential(nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
        self.float32_inside, self.cache, self.precomputed_edges = float32_inside, cache, precomputed_edges
        self.own_forces, self.scale_forces, self.detach_forces = own_forces, scale_forces, detach_forces
        self.feature_dict: dict[str, torch.Tensor] = {}

    def _read(self, g: Any, key: str) -> torch.Tensor:
        return g[key] if isinstance(g, dict) else getattr(g, key)

    def forward(self, g: Any) -> dict[str, torch.Tensor]:
        pos, cell, frame = self._read(g, "pos"), self._read(g, "cell"), self._read(g, "batch")
        nf = cell.shape[0]
        i, j = self._read(g, "edge_index")
        if self.own_forces:
            pos = pos.detach().requires_grad_(True)
        strain = torch.zeros(nf, 3, 3, dtype=pos.dtype, requires_grad=self.own_forces)
        if self.precomputed_edges:  # SevenNet: the model reads edge vectors made with the batch
            vec = self._read(g, "edge_vec")
            if self.own_forces:
                vec = vec.detach().requires_grad_(True)
        else:
            sym = 0.5 * (strain + strain.transpose(-1, -2))
            p = pos + (pos.unsqueeze(-2) @ sym[frame]).squeeze(-2)
            c = cell + cell @ sym
            vec = p[j] - p[i] + (self._read(g, "shift").unsqueeze(-2) @ c[frame[i]]).squeeze(-2)
        r = vec.norm(dim=-1)
        n = torch.arange(1, 7, dtype=r.dtype)
        rbf = torch.sin(n * math.pi * r.unsqueeze(-1) / self.cutoff) / r.unsqueeze(-1)
        smooth = torch.where(
            r < self.cutoff, 0.5 * (1 + torch.cos(math.pi * r / self.cutoff)), torch.zeros_like(r)
        )
        h = self.radial(rbf.float() if self.float32_inside else rbf)  # SevenNet's .float() inside
        s = self._read(g, "species")
        h = h * (self.species(s[i]) * self.species(s[j])).sum(-1, keepdim=True)
        e_edge = self.out(h).squeeze(-1) * smooth
        energy = torch.zeros(nf, dtype=e_edge.dtype).index_add(0, frame[i], e_edge)
        if self.cache:  # matgl: intermediate features kept on the model, refilled by every call
            self.feature_dict = {"edges": e_edge, "radial": h}
        out = {"energy": energy}
        if not self.own_forces:
            return out
        create = self.training and not self.detach_forces
        if self.precomputed_edges:
            (dvec,) = torch.autograd.grad(energy.sum(), [vec], create_graph=create)
            forces = torch.zeros_like(pos).index_add(0, i, dvec).index_add(0, j, -dvec)
            virial = torch.zeros(nf, 3, 3, dtype=pos.dtype).index_add(
                0, frame[i], vec.unsqueeze(-1) * dvec.unsqueeze(-2)
            )
            stress = virial / torch.linalg.det(cell).abs().reshape(-1, 1, 1)
        else:
            dpos, dstrain = torch.autograd.grad(energy.sum(), [pos, strain], create_graph=create)
            forces = -dpos
            stress = dstrain / torch.linalg.det(cell).abs().reshape(-1, 1, 1)  # ASE: (1/V) dE/d(strain)
        return {**out, "forces": self.scale_forces * forces, "stress": stress}


def tiny(dtype: torch.dtype = torch.float64, seed: int = 0, **switches: Any) -> PairPotential:
    torch.manual_seed(seed)
    model = PairPotential(**switches)
    return model.to(dtype) if not switches.get("float32_inside") else model.float()
