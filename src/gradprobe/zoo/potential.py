"""A small but real machine-learned interatomic potential, modelled on DeePMD's ``se_e2_a``.

Energy is a sum of atomic energies predicted from a smooth, rotation/translation-invariant
descriptor of each atom's neighbourhood; forces and the virial come from autograd w.r.t. the
*extended* (periodic-image) coordinates, exactly as DeePMD-kit's PyTorch backend does it. Two
DeePMD-style pitfalls are kept on purpose so that gradprobe has something real to find:

* ``create_graph=self.training`` in the force ``autograd.grad``: in eval mode the forces come
  out detached, so a force loss computed in eval mode trains nothing;
* ``ghost_force="slice"``: forces on periodic images are dropped instead of being folded back
  onto their local atoms (plausible-looking because the local atoms are the first ``nloc``).

All shapes are static (every frame has ``27 * nloc`` extended atoms and ``sel`` neighbour slots),
so the model traces with ``make_fx`` and compiles with ``torch.compile``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

GHOST_FORCE_MODES = ("scatter", "slice")


def image_shifts(box: Tensor) -> Tensor:
    """Cartesian shifts of the 27 periodic images, shape (nf, 27, 3); the zero shift is first."""
    order = (0, -1, 1)  # 0 first on every axis, so image 0 is the unshifted cell
    n = [[i, j, k] for i in order for j in order for k in order]
    # (27, 3) @ (nf, 3, 3): integer combinations of the cell vectors (the rows of box)
    return torch.tensor(n, dtype=box.dtype, device=box.device) @ box


def extend_coord(coord: Tensor, box: Tensor) -> tuple[Tensor, Tensor]:
    """Wrap ``coord`` into the cell and build all 27 images of it.

    Returns ``(extended_coord (nf, 27*nloc, 3), mapping (nf, 27*nloc))``; the first ``nloc``
    extended atoms are the local atoms themselves. Differentiable in ``coord`` and ``box`` (the
    wrapping shift is an integer lattice vector, so it only moves atoms by whole cells). The 27
    images contain every neighbour within ``rcut`` as long as ``rcut`` is below the cell's
    smallest perpendicular width.
    """
    nf, nloc, _ = coord.shape
    cells = torch.floor(coord @ torch.linalg.inv(box)).detach()
    wrapped = coord - cells @ box
    ext = (wrapped[:, None, :, :] + image_shifts(box)[:, :, None, :]).reshape(nf, 27 * nloc, 3)
    mapping = torch.arange(nloc, device=coord.device).repeat(27).expand(nf, -1)
    return ext, mapping


class Descriptor(nn.Module):
    """se_e2_a descriptor: D_i = T_i T_i[:axis]^T with T_i = G_i^T R_i / sel."""

    def __init__(
        self,
        type_dim: int,
        embed_widths: tuple[int, int],
        axis: int,
        sel: int,
        detach_embedding: bool = False,
    ) -> None:
        super().__init__()
        if axis > embed_widths[1]:
            raise ValueError(f"axis={axis} must not exceed embed_widths[1]={embed_widths[1]}")
        self.embed1 = nn.Linear(1 + type_dim, embed_widths[0])
        self.embed2 = nn.Linear(embed_widths[0], embed_widths[1])
        self.axis = axis
        self.sel = sel
        self.detach_embedding = detach_embedding
        self.dim = embed_widths[1] * axis

    def forward(self, env: Tensor, nei_tebd: Tensor) -> Tensor:
        """``env`` (nf, nloc, sel, 4), ``nei_tebd`` (nf, nloc, sel, type_dim) -> (nf, nloc, dim)."""
        g = torch.tanh(self.embed1(torch.cat([env[..., :1], nei_tebd], dim=-1)))
        if self.detach_embedding:  # BUG switch (graph-break-in-model): cuts embed1 off every loss term
            g = g.detach()
        g = torch.tanh(self.embed2(g))  # (nf, nloc, sel, M1)
        # Masked neighbours have env == 0, so their (meaningless) G rows drop out here.
        t = torch.einsum("fnsm,fnsk->fnmk", g, env) / self.sel  # (nf, nloc, M1, 4)
        # Contracting the 4-vector index removes the rotation: D is invariant.
        d = torch.einsum("fnmk,fnak->fnma", t, t[:, :, : self.axis])
        return d.flatten(-2)


class FittingNet(nn.Module):
    """Per-atom energy from [descriptor, own type embedding]."""

    def __init__(self, in_dim: int, fit_widths: tuple[int, int]) -> None:
        super().__init__()
        self.layer1 = nn.Linear(in_dim, fit_widths[0])
        self.layer2 = nn.Linear(fit_widths[0], fit_widths[1])
        self.out = nn.Linear(fit_widths[1], 1)

    def forward(self, x: Tensor) -> Tensor:
        """(…, in_dim) -> (…,) atomic energy (without the per-type shift)."""
        return self.out(torch.tanh(self.layer2(torch.tanh(self.layer1(x))))).squeeze(-1)


class ReferencePotential(nn.Module):
    """DeePMD se_e2_a-like potential; ``forward`` returns energy, forces, virial and an aux head."""

    #: Fixed scale dividing the environment matrix. DeePMD normalises it with per-type data
    #: statistics; a constant keeps the model free of a statistics pass, and without it the
    #: descriptor (a square of 1/sel-averaged small numbers) and hence the forces at
    #: initialisation would be ~1e-5, far below any label.
    env_std: float = 0.04

    def __init__(
        self,
        ntypes: int = 2,
        rcut: float = 4.0,
        rcut_smooth: float = 0.5,
        sel: int = 32,
        type_dim: int = 4,
        embed_widths: tuple[int, int] = (8, 16),
        axis: int = 4,
        fit_widths: tuple[int, int] = (24, 24),
        aux_dim: int = 2,
        ghost_force: str = "scatter",
        detach_embedding: bool = False,
        unsafe_distance: bool = False,
        recreate_coords: bool = False,
    ) -> None:
        super().__init__()
        if ghost_force not in GHOST_FORCE_MODES:
            raise ValueError(f"ghost_force must be one of {GHOST_FORCE_MODES}, got {ghost_force!r}")
        if not 0.0 < rcut_smooth < rcut:
            raise ValueError(f"need 0 < rcut_smooth < rcut, got rcut_smooth={rcut_smooth}, rcut={rcut}")
        self.ntypes, self.rcut, self.rcut_smooth, self.sel = ntypes, rcut, rcut_smooth, sel
        self.ghost_force = ghost_force
        # Switches that inject known bugs (gradprobe.zoo.bugs); all off is the correct potential.
        self.unsafe_distance = unsafe_distance
        self.recreate_coords = recreate_coords
        self.type_embedding = nn.Embedding(ntypes, type_dim)
        self.descriptor = Descriptor(type_dim, embed_widths, axis, sel, detach_embedding)
        self.fitting = FittingNet(self.descriptor.dim + type_dim, fit_widths)
        # Constant per-type atomic energy (like DeePMD's bias_atom_e): it moves E but no force.
        self.energy_shift = nn.Parameter(-torch.arange(1, ntypes + 1, dtype=torch.get_default_dtype()))
        # Auxiliary "atomic charge" head: returned, but no loss term uses it (legitimately unused).
        self.aux_head = nn.Linear(self.descriptor.dim, aux_dim)

    # ----------------------------------------------------------------- geometry helpers
    def _distances(self, ext_coord: Tensor, nloc: int) -> Tensor:
        """Local-to-extended distances (nf, nloc, nall), +inf for self and beyond rcut."""
        with torch.no_grad():  # the neighbour list is integer data: no gradient through it
            dist = (ext_coord[:, None, :, :] - ext_coord[:, :nloc, None, :]).norm(dim=-1)
            is_self = torch.eye(nloc, ext_coord.shape[1], dtype=torch.bool, device=dist.device)
            return dist.masked_fill(is_self | (dist >= self.rcut), float("inf"))

    def neighbour_list(self, ext_coord: Tensor, nloc: int) -> Tensor:
        """Indices (nf, nloc, sel) of the ``sel`` nearest extended atoms within rcut, -1 = empty.

        Does not check for overflow (that would be data-dependent control flow and break
        tracing): neighbours beyond the ``sel`` nearest are silently dropped. Use
        :meth:`count_max_neighbours` on your data to check that ``sel`` is large enough.
        """
        dist = self._distances(ext_coord, nloc)
        k = min(self.sel, dist.shape[-1])
        with torch.no_grad():
            vals, idx = torch.topk(dist, k, dim=-1, largest=False)
            nlist = torch.where(torch.isfinite(vals), idx, torch.full_like(idx, -1))
            if k < self.sel:  # static (shape-only) condition: pad to a fixed width
                nlist = nn.functional.pad(nlist, (0, self.sel - k), value=-1)
        return nlist

    def count_max_neighbours(self, coord: Tensor, atype: Tensor, box: Tensor) -> int:
        """Largest number of neighbours within rcut of any atom; must be <= ``sel``."""
        del atype  # neighbours are counted regardless of type (se_e2_a with mixed types)
        ext_coord, _ = extend_coord(coord.detach(), box.detach())
        return int(torch.isfinite(self._distances(ext_coord, coord.shape[1])).sum(-1).max())

    def _switch(self, r: Tensor) -> Tensor:
        """s(r) = u(x)/r, u a C2 quintic from 1 (r <= rcut_smooth) to 0 (r >= rcut)."""
        x = ((r - self.rcut_smooth) / (self.rcut - self.rcut_smooth)).clamp(0.0, 1.0)
        return (x**3 * (-6.0 * x**2 + 15.0 * x - 10.0) + 1.0) / r

    # ------------------------------------------------------------------- the model
    def _atomic(
        self, ext_coord: Tensor, atype: Tensor, mapping: Tensor, nlist: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Atomic energies (nf, nloc) and aux output (nf, nloc, aux_dim)."""
        nf, nloc = atype.shape
        mask = nlist >= 0
        flat = nlist.clamp(min=0).reshape(nf, nloc * self.sel)
        nei = torch.gather(ext_coord, 1, flat[..., None].expand(-1, -1, 3)).reshape(nf, nloc, self.sel, 3)
        rij = nei - ext_coord[:, :nloc, None, :]  # centre taken from ext_coord: it gets a force too
        r2 = (rij * rij).sum(-1)
        # Masked slots may point at the centre atom itself (r = 0); a safe r = 1 keeps sqrt, the
        # division and their double backward finite, and the mask then zeroes them exactly.
        if self.unsafe_distance:
            # BUG switch (nonfinite-grad): sqrt(0) on masked slots; torch.where hides the inf in the
            # forward, but its backward multiplies 0 by inf: NaN forces.
            s = torch.where(mask, self._switch(torch.sqrt(r2)), torch.zeros_like(r2))
            r = torch.where(mask, torch.sqrt(r2), torch.ones_like(r2))
        else:
            r = torch.sqrt(torch.where(mask, r2, torch.ones_like(r2)))
            s = self._switch(r) * mask.to(r.dtype)
        env = torch.cat([s[..., None], s[..., None] * rij / r[..., None]], dim=-1) / self.env_std
        nei_type = torch.gather(torch.gather(atype, 1, mapping), 1, flat).reshape(nf, nloc, self.sel)
        d = self.descriptor(env, self.type_embedding(nei_type))
        fit_in = torch.cat([d, self.type_embedding(atype)], dim=-1)
        atom_energy = self.fitting(fit_in) + self.energy_shift[atype]
        return atom_energy, self.aux_head(d)

    def energy(self, coord: Tensor, atype: Tensor, box: Tensor) -> Tensor:
        """Total energy (nf,) as a plain differentiable function of ``coord`` and ``box``."""
        ext_coord, mapping = extend_coord(coord, box)
        nlist = self.neighbour_list(ext_coord, coord.shape[1])
        return self._atomic(ext_coord, atype, mapping, nlist)[0].sum(-1)

    def forward(self, coord: Tensor, atype: Tensor, box: Tensor) -> dict[str, Tensor]:
        """``coord`` (nf, nloc, 3), ``atype`` (nf, nloc) long, ``box`` (nf, 3, 3) rows = cell vectors.

        Returns ``energy`` (nf,), ``atom_energy`` (nf, nloc), ``force`` (nf, nloc, 3),
        ``virial`` (nf, 3, 3) and ``aux`` (nf, nloc, aux_dim). Needs grad mode (forces are
        autograd derivatives), like DeePMD.
        """
        nloc = coord.shape[1]
        ext_coord, mapping = extend_coord(coord, box)
        # As in DeePMD: forces are derivatives w.r.t. a fresh leaf, the extended coordinates.
        ext_coord = ext_coord.detach().requires_grad_(True)
        # BUG switch (requires-grad-placement): a "canonicalised" copy is what the model consumes, so
        # the leaf that autograd.grad differentiates never enters the energy's graph.
        consumed = ext_coord.detach().clone() if self.recreate_coords else ext_coord
        nlist = self.neighbour_list(consumed, nloc)
        atom_energy, aux = self._atomic(consumed, atype, mapping, nlist)
        energy = atom_energy.sum(-1)
        # DeePMD ties create_graph to training mode; in eval mode forces are therefore detached.
        grad = torch.autograd.grad(energy.sum(), ext_coord, create_graph=self.training, allow_unused=True)[0]
        if grad is None:  # defensive code of the kind that makes the placement bug silent
            grad = torch.zeros_like(ext_coord)
        ext_force = -grad
        if self.ghost_force == "scatter":  # fold image forces back onto their local atoms
            index = mapping[..., None].expand(-1, -1, 3)
            force = torch.zeros_like(ext_force[:, :nloc]).scatter_add(1, index, ext_force)
        else:  # BUG kept on purpose: drops every force acting on a periodic image
            force = ext_force[:, :nloc]
        # virial_ab = sum_i x_ia F_ib = -dE/d(strain_ab); coordinates are data, so detached.
        virial = torch.einsum("fia,fib->fab", ext_coord.detach(), ext_force)
        return {"energy": energy, "atom_energy": atom_energy, "force": force, "virial": virial, "aux": aux}
