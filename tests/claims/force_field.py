"""Two learned force fields, forces as minus the gradient of the energy in the positions:

- a coarse-grained bead model (``BeadField``): pair distances in a Gaussian basis, a pair network with
  batch normalisation, forces with ``create_graph=self.training``. Bug ``beads-eval-in-step``: the step
  calls a helper meant to freeze the normalisation statistics, which calls ``model.eval()`` on the whole
  model, so the forces come out with no gradient path. Root: the ``.eval()`` line.
- a small-molecule potential (``DensityField``): per-atom Gaussian densities of the neighbours and a
  per-atom network. Bug ``mol-coords-recreated``: a user trainer path marks the coordinates
  ``requires_grad_`` and then canonicalises them (centring) with ``.clone().detach()``; the energy is
  computed from the re-created tensor and ``autograd.grad(..., materialize_grads=True)`` returns zero
  forces. Root: the line that re-creates the tensor.
"""

from __future__ import annotations

import torch
from torch import nn

import gradprobe

from . import autograd_of, case, grown, moves, ones_for, params_of, reached, truth, weighted

TERMS = ("energy", "force")


def pair_distances(pos: torch.Tensor) -> torch.Tensor:
    """(frames, n, 3) -> (frames, n*(n-1)/2) distances."""
    n = pos.shape[1]
    i, j = torch.triu_indices(n, n, offset=1)
    return (pos[:, i] - pos[:, j]).norm(dim=-1)


class BeadField(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("centres", torch.linspace(0.5, 3.0, 10))
        self.pair_net = nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))

    def energy(self, pos: torch.Tensor) -> torch.Tensor:
        d = pair_distances(pos)
        basis = torch.exp(-4.0 * (d[..., None] - self.centres) ** 2)
        pair = self.pair_net(basis.reshape(-1, basis.shape[-1])).reshape(d.shape)
        return pair.sum(dim=-1)

    def forward(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = pos.clone().requires_grad_(True)
        e = self.energy(pos)
        (de,) = torch.autograd.grad(e.sum(), pos, create_graph=self.training)
        return e, -de


def freeze_norm_statistics(model: nn.Module) -> None:
    """Fine-tuning: keep the BatchNorm running statistics as they are."""
    model.eval()  # ROOT beads-eval-in-step


def freeze_norm_statistics_fixed(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.BatchNorm1d):
            m.eval()


def bead_frames() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(28)
    lattice = torch.tensor(
        [[0, 0, 0], [1.2, 0, 0], [0, 1.2, 0], [0, 0, 1.2], [1.2, 1.2, 0]], dtype=torch.float64
    )
    beads = lattice + 0.15 * torch.randn(6, 5, 3, generator=g, dtype=torch.float64)
    return {
        "beads": beads,
        "e_ref": torch.randn(6, generator=g, dtype=torch.float64),
        "f_ref": 0.1 * torch.randn(6, 5, 3, generator=g, dtype=torch.float64),
    }


def bead_losses(model: BeadField, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    e, f = model(batch["beads"])
    return {"energy": ((e - batch["e_ref"]) ** 2).mean(), "force": ((f - batch["f_ref"]) ** 2).mean()}


def finetune_step(model: BeadField, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    freeze_norm_statistics(model)
    return bead_losses(model, batch)


def finetune_step_fixed(model: BeadField, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    freeze_norm_statistics_fixed(model)
    return bead_losses(model, batch)


def _bead_model() -> BeadField:
    model = BeadField()
    with torch.no_grad():  # running statistics as after pre-training
        model.pair_net[1].running_mean.uniform_(0.0, 0.2)
        model.pair_net[1].running_var.uniform_(0.5, 1.5)
    return model


@case(
    "beads-eval-in-step",
    family="force_field",
    mechanism="model.eval() inside the step",
    expect={"trace-eval-mode"},
)
def build_beads(fixed: bool):
    return grown(29, _bead_model), finetune_step_fixed if fixed else finetune_step, bead_frames(), {}


@truth("beads-eval-in-step")
def check_beads(fixed: bool) -> None:
    model, step, batch, _ = build_beads(fixed)
    model.train()
    params = params_of(model)
    try:
        force = step(model, batch)["force"]
        assert model.training == fixed
    finally:
        model.train()
    grads = autograd_of(force, params)
    if fixed:
        assert reached(grads["pair_net.0.weight"])
    else:
        assert all(g is None for g in grads.values())

        def value() -> torch.Tensor:
            try:
                return step(model, batch)["force"]
            finally:
                model.train()

        assert moves(value, params["pair_net.0.weight"]) > 1e-9


# ----- mol-coords-recreated ---------------------------------------------------------------------------


class DensityField(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.species = nn.Embedding(3, 8)
        self.register_buffer("shells", torch.linspace(0.8, 2.6, 8))
        self.atom_net = nn.Sequential(nn.Linear(8, 24), nn.CELU(), nn.Linear(24, 1))

    def forward(self, xyz: torch.Tensor, kinds: torch.Tensor) -> torch.Tensor:
        rij = (xyz[:, :, None] - xyz[:, None, :]).pow(2).sum(-1).add(1e-12).sqrt()
        n = xyz.shape[1]
        off_diag = 1.0 - torch.eye(n, dtype=xyz.dtype)
        density = (torch.exp(-3.0 * (rij[..., None] - self.shells) ** 2) * off_diag[..., None]).sum(dim=2)
        atoms = self.atom_net(density * self.species(kinds)).squeeze(-1)
        return atoms.sum(dim=-1)


def molecules() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(30)
    base = torch.tensor([[0, 0, 0], [1.0, 0, 0], [-0.3, 0.95, 0], [0.2, -0.4, 0.9]], dtype=torch.float64)
    return {
        "xyz": base + 0.08 * torch.randn(5, 4, 3, generator=g, dtype=torch.float64) + 3.0,
        "kinds": torch.tensor([0, 1, 1, 2]),
        "e_ref": torch.randn(5, generator=g, dtype=torch.float64),
        "f_ref": 0.1 * torch.randn(5, 4, 3, generator=g, dtype=torch.float64),
    }


def molecule_step(model: DensityField, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    xyz = batch["xyz"].clone().requires_grad_(True)
    e = model(xyz, batch["kinds"])
    (de,) = torch.autograd.grad(e.sum(), xyz, create_graph=True)
    return {"energy": ((e - batch["e_ref"]) ** 2).mean(), "force": ((-de - batch["f_ref"]) ** 2).mean()}


def canonicalise(xyz: torch.Tensor) -> torch.Tensor:
    """Centre each molecule at the origin (the trainer's data pipeline)."""
    return (xyz - xyz.mean(dim=1, keepdim=True)).clone().detach()  # ROOT mol-coords-recreated


def pipeline_trainer(grad_before_canonical: bool):
    def builder(ctx):
        model = ctx.model

        def run(batch, weights):
            if grad_before_canonical:
                xyz = batch["xyz"].clone().requires_grad_(True)
                inputs = canonicalise(xyz)
            else:
                xyz = canonicalise(batch["xyz"]).requires_grad_(True)
                inputs = xyz
            e = model(inputs, batch["kinds"])
            (de,) = torch.autograd.grad(e.sum(), xyz, create_graph=True, materialize_grads=True)
            terms = {
                "energy": ((e - batch["e_ref"]) ** 2).mean(),
                "force": ((-de - batch["f_ref"]) ** 2).mean(),
            }
            return weighted(terms, weights)

        return run

    return builder


@case(
    "mol-coords-recreated",
    family="force_field",
    mechanism="coordinates re-created after requires_grad_",
    container="opaque-eager",
    expect={"requires-grad-placement"},
)
def build_molecule(fixed: bool):
    path = gradprobe.variants.user_variant(
        "pipeline_trainer", pipeline_trainer(grad_before_canonical=not fixed)
    )
    return (
        grown(31, DensityField),
        molecule_step,
        molecules(),
        {"variants": ["eager", path], "terms": list(TERMS)},
    )


@truth("mol-coords-recreated")
def check_molecule(fixed: bool) -> None:
    model, step, batch, kw = build_molecule(fixed)
    run = kw["variants"][1].builder(type("Ctx", (), {"model": model, "batch": batch})())
    only = ones_for(TERMS, ["force"], torch.float64)
    total, values = run(batch, only)
    params = params_of(model)
    ref = step(model, batch)["force"]
    torch.testing.assert_close(values["energy"], step(model, batch)["energy"])
    if fixed:
        torch.testing.assert_close(values["force"], ref)  # centring does not change the forces
        assert reached(autograd_of(total, params)["atom_net.0.weight"])
    else:
        # The forces came out as zeros that reach no parameter, though the reference's depend on them.
        torch.testing.assert_close(values["force"], (batch["f_ref"] ** 2).mean())
        assert not any(reached(g) for g in autograd_of(total, params).values())
        assert not torch.allclose(values["force"], ref)
