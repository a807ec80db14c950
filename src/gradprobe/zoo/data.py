"""Synthetic periodic frames labelled by an analytic teacher (a smooth Morse pair potential).

The teacher is evaluated over the same 27 periodic images as :mod:`gradprobe.zoo.potential`, and
its forces and virial follow the same conventions (forces = -dE/dx, virial_ab = sum x_a F_b
over extended atoms), so the reference model can in principle fit the labels exactly in form.
Everything is generated on the CPU in float64 with a private ``torch.Generator`` (deterministic,
the global RNG is never touched) and only then cast to the requested dtype/device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .potential import extend_coord

TEACHER_RCUT = 4.0
TEACHER_RCUT_SMOOTH = 3.0
MIN_DISTANCE = 1.5
_MAX_TRIES = 10_000


def _pair_params(atype: Tensor, ext_type: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Type-dependent Morse depth, stiffness and equilibrium distance, each (nf, nloc, nall)."""
    ti = atype[:, :, None].to(torch.float64)
    tj = ext_type[:, None, :].to(torch.float64)
    depth = 0.3 + 0.1 * (ti + tj)
    alpha = 1.4 + 0.2 * (ti - tj).abs()
    r0 = 2.0 + 0.15 * (ti + tj)
    return depth, alpha, r0


def _teacher_from_ext(ext_coord: Tensor, atype: Tensor, mapping: Tensor) -> Tensor:
    """Teacher energy (nf,): per-type constants + half the sum of smooth Morse pair terms."""
    nloc = atype.shape[1]
    rij = ext_coord[:, None, :, :] - ext_coord[:, :nloc, None, :]
    r2 = (rij * rij).sum(-1)
    not_self = ~torch.eye(nloc, ext_coord.shape[1], dtype=torch.bool, device=r2.device)
    r = torch.sqrt(torch.where(not_self, r2, torch.ones_like(r2)))  # safe r: no NaN gradients
    depth, alpha, r0 = _pair_params(atype, torch.gather(atype, 1, mapping))
    morse = depth.to(r) * ((1.0 - torch.exp(-alpha.to(r) * (r - r0.to(r)))) ** 2 - 1.0)
    x = ((r - TEACHER_RCUT_SMOOTH) / (TEACHER_RCUT - TEACHER_RCUT_SMOOTH)).clamp(0.0, 1.0)
    cutoff = x**3 * (-6.0 * x**2 + 15.0 * x - 10.0) + 1.0  # C2 switch, exactly 0 beyond TEACHER_RCUT
    pair = 0.5 * (morse * cutoff * not_self.to(r.dtype)).sum((-1, -2))  # 0.5: each pair seen twice
    return pair - (atype + 1).to(r.dtype).sum(-1)  # on-site energies -1, -2, ... per type


def teacher_energy(coord: Tensor, atype: Tensor, box: Tensor) -> Tensor:
    """Teacher energy (nf,) as a plain differentiable function of ``coord`` and ``box``."""
    ext, mapping = extend_coord(coord, box)
    return _teacher_from_ext(ext, atype, mapping)


def teacher_labels(coord: Tensor, atype: Tensor, box: Tensor) -> dict[str, Tensor]:
    """Teacher ``energy`` (nf,), ``force`` (nf, nloc, 3) and ``virial`` (nf, 3, 3), all detached."""
    nloc = coord.shape[1]
    ext, mapping = extend_coord(coord.detach(), box.detach())
    ext = ext.requires_grad_(True)
    with torch.enable_grad():
        energy = _teacher_from_ext(ext, atype, mapping)
        ext_force = -torch.autograd.grad(energy.sum(), ext)[0]
    index = mapping[..., None].expand(-1, -1, 3)
    force = torch.zeros_like(ext_force[:, :nloc]).scatter_add(1, index, ext_force)
    virial = torch.einsum("fia,fib->fab", ext.detach(), ext_force)
    return {"energy": energy.detach(), "force": force, "virial": virial}


def _perpendicular_widths(box: Tensor) -> Tensor:
    """Distance between opposite faces of each cell, (nf, 3)."""
    vol = torch.linalg.det(box).abs()[:, None]
    areas = torch.stack([torch.linalg.cross(box[:, (k + 1) % 3], box[:, (k + 2) % 3]) for k in range(3)], 1)
    return vol / areas.norm(dim=-1)


def _place_atoms(box: Tensor, natoms: int, gen: torch.Generator) -> Tensor:
    """Random positions (natoms, 3) in one cell, every periodic pair at least MIN_DISTANCE apart."""
    order = (0, -1, 1)
    shifts = torch.tensor([[i, j, k] for i in order for j in order for k in order], dtype=box.dtype) @ box
    placed: list[Tensor] = []
    for _ in range(_MAX_TRIES):
        cand = torch.rand(3, generator=gen, dtype=box.dtype) @ box
        if placed:
            images = torch.stack(placed)[:, None, :] + shifts[None]  # (n, 27, 3)
            if (images - cand).norm(dim=-1).min() < MIN_DISTANCE:
                continue  # rejection sampling: too close to an atom or one of its images
        placed.append(cand)
        if len(placed) == natoms:
            return torch.stack(placed)
    raise RuntimeError(
        f"could not place {natoms} atoms {MIN_DISTANCE} apart in {_MAX_TRIES} tries: "
        "use fewer atoms or a larger box_length"
    )


def make_batch(
    nframes: int = 2,
    natoms: int = 8,
    ntypes: int = 2,
    *,
    seed: int = 0,
    box_length: float = 6.0,
    dtype: torch.dtype = torch.float64,
    device: str | torch.device = "cpu",
    with_virial: bool = True,
) -> dict[str, Tensor]:
    """A deterministic batch of periodic frames with teacher labels.

    Keys: ``coord`` (nf, natoms, 3), ``atype`` (nf, natoms) long (every type occurs in the
    batch), ``box`` (nf, 3, 3) (rows are cell vectors: a near-cubic cell of side ``box_length``
    with a small triclinic perturbation), ``energy`` (nf,), ``force`` (nf, natoms, 3) and, when
    ``with_virial``, ``virial`` (nf, 3, 3). A different ``seed`` gives a batch of the same shapes.
    """
    if nframes * natoms < ntypes:
        raise ValueError(f"{nframes} frames of {natoms} atoms cannot hold all {ntypes} types")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    f64 = torch.float64
    perturb = 0.04 * (2.0 * torch.rand(nframes, 3, 3, generator=gen, dtype=f64) - 1.0)
    box = box_length * (torch.eye(3, dtype=f64) + perturb)
    # The 27 images only contain every neighbour within the cutoff if the cell is wide enough.
    if _perpendicular_widths(box).min() <= TEACHER_RCUT:
        raise ValueError(f"box_length={box_length} is too small: the cell must be wider than {TEACHER_RCUT}")
    coord = torch.stack([_place_atoms(box[f], natoms, gen) for f in range(nframes)])
    atype = torch.randint(ntypes, (nframes, natoms), generator=gen)
    # Make sure every type is present somewhere, at random positions of frame 0.
    first = torch.randperm(natoms, generator=gen)[: min(ntypes, natoms)]
    atype[0, first] = torch.arange(len(first))
    if ntypes > natoms:  # the remaining types go to the following frames
        atype.view(-1)[natoms:ntypes] = torch.arange(natoms, ntypes)
    labels = teacher_labels(coord, atype, box)
    batch = {"coord": coord, "atype": atype, "box": box, **labels}
    if not with_virial:
        del batch["virial"]
    return {k: v.to(device) if k == "atype" else v.to(device=device, dtype=dtype) for k, v in batch.items()}
