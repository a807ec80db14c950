"""Atoms in a batch, for the physics check: where the positions, cells and frames are, and the batch
with them moved.

Two layouts, one reading:

* stacked frames in a dict (``coord`` ``(frames, atoms, 3)``, ``box`` ``(frames, 3, 3)``): the
  ``ProbeSpec``'s ``coord_key`` and ``box_key``;
* a graph batch: positions ``(atoms, 3)`` with a per-atom frame index (PyG's ``batch``), in a PyG
  ``Data``/``Batch``, a dict, a tuple or nested ones, each found by a path (``"pos"``,
  ``"g.frac_coords"``, ``"0.pos"``); Cartesian or fractional; cells ``(3, 3)`` (one for every frame),
  ``(frames, 3, 3)`` or ``(3·frames, 3)``; and ``rebuild`` for what the model reads that was computed
  from the positions before it was called (edge vectors of a neighbour list).

Either way the check sees ``Atoms``: Cartesian positions ``(atoms, 3)``, the frame of each atom and
the cells ``(frames or 1, 3, 3)``. ``moved`` gives a new batch with other positions and cells, copying
each container on the way down the path (a dict, a tuple, a ``Data``: shallow copies): the user's batch
is never written.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .errors import SpecError

Path = str | int
# Positions the physics check looks for when none are named, in this order.
POSITION_NAMES = ("pos", "positions", "R", "coord", "coords", "coordinates")
CELL_NAMES = ("cell", "box", "lattice", "lat")


def _parts(path: Path) -> list[str]:
    return [str(path)] if isinstance(path, int) else [p for p in str(path).split(".") if p]


def _child(obj: Any, part: str) -> Any:
    if isinstance(obj, Mapping):
        return obj[part]
    if isinstance(obj, list | tuple) and part.lstrip("-").isdigit():
        return obj[int(part)]
    return getattr(obj, part)  # a PyG Data reads its keys as attributes


def get(obj: Any, path: Path) -> Any:
    """The value at ``path`` (``"g.pos"``: key, attribute or index at each step); raises LookupError."""
    for part in _parts(path):
        try:
            obj = _child(obj, part)
        except (KeyError, IndexError, AttributeError, TypeError) as e:
            raise LookupError(part) from e
    return obj


def has(obj: Any, path: Path | None) -> bool:
    if path is None:
        return False
    try:
        get(obj, path)
    except LookupError:
        return False
    return True


def _with_child(obj: Any, part: str, value: Any) -> Any:
    if isinstance(obj, dict):
        return {**obj, part: value}
    if isinstance(obj, tuple) and part.lstrip("-").isdigit():
        items = list(obj)
        items[int(part)] = value
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)  # a namedtuple keeps its type
    if isinstance(obj, list) and part.lstrip("-").isdigit():
        items = list(obj)
        items[int(part)] = value
        return items
    new = copy.copy(obj)  # a PyG Data copies its stores, not their tensors
    if isinstance(obj, Mapping):
        new[part] = value
    else:
        setattr(new, part, value)
    return new


def replaced(obj: Any, path: Path, value: Any) -> Any:
    """``obj`` with ``value`` at ``path``: each container on the way is copied, ``obj`` is not written."""
    parts = _parts(path)
    if not parts:
        return value
    head = _child(obj, parts[0])
    inner = replaced(head, ".".join(parts[1:]), value) if len(parts) > 1 else value
    return _with_child(obj, parts[0], inner)


def shallow(batch: Any) -> Any:
    """A copy of the batch's top container (a model that writes its outputs into the batch it is given,
    as SevenNet's does, then leaves the caller's batch as it was)."""
    if isinstance(batch, dict | list):
        return type(batch)(batch) if type(batch) in (dict, list) else copy.copy(batch)
    if isinstance(batch, torch.Tensor | tuple):
        return batch
    try:
        return copy.copy(batch)
    except Exception:  # an object that refuses a copy: handed over as it is
        return batch


@dataclass(frozen=True)
class Atoms:
    """What the check reads of a batch: Cartesian positions ``(atoms, 3)``, the frame of each atom,
    the number of frames, and the cells ``(frames, 3, 3)`` or ``(1, 3, 3)`` (one for all), or None."""

    positions: torch.Tensor
    frame: torch.Tensor
    frames: int
    cells: torch.Tensor | None

    def counts(self) -> torch.Tensor:
        return torch.bincount(self.frame, minlength=self.frames)


Rebuild = Callable[[Any, Atoms], Any]


@dataclass(frozen=True)
class Geometry:
    """Where a batch keeps its atoms (see the module's docstring).

    Args:
        positions: path to the positions: ``(atoms, 3)``, or ``(frames, atoms, 3)`` stacked.
        cell: path to the cells, or None (not periodic: no virial check).
        frames: path to the per-atom frame index of a graph batch (PyG's ``batch``); absent: one frame.
        fractional: the positions are fractional coordinates of the cell (matgl's ``frac_coords``).
        rebuild: ``rebuild(batch, atoms) -> batch``, what the model reads that the batch computed from
            the positions before the model ran (``edge_vectors``), redone for moved atoms.
    """

    positions: Path = "pos"
    cell: Path | None = "cell"
    frames: Path | None = "batch"
    fractional: bool = False
    rebuild: Rebuild | None = None

    def read(self, batch: Any) -> Atoms:
        try:
            pos = get(batch, self.positions)
        except LookupError:
            raise SpecError(_not_found("positions", self.positions, batch)) from None
        if not isinstance(pos, torch.Tensor) or pos.shape[-1:] != (3,) or pos.dim() not in (2, 3):
            raise SpecError(
                f"the physics check needs positions of shape (atoms, 3) or (frames, atoms, 3) at "
                f"{self.positions!r}; found {_shape(pos)}"
            )
        cells = None
        if self.cell is not None and has(batch, self.cell):
            cells = _cells(get(batch, self.cell), self.cell)
        if pos.dim() == 3:
            nf, na = pos.shape[:2]
            frame = torch.arange(nf, device=pos.device).repeat_interleave(na)
            pos = pos.reshape(-1, 3)
        else:
            index = get(batch, self.frames) if has(batch, self.frames) else None
            if isinstance(index, torch.Tensor) and index.shape == pos.shape[:1]:
                frame = index.to(device=pos.device, dtype=torch.long)
            else:
                frame = torch.zeros(len(pos), dtype=torch.long, device=pos.device)
            nf = int(frame.max()) + 1 if len(frame) else 0
            if cells is not None and cells.shape[0] not in (1, nf):
                raise SpecError(
                    f"{cells.shape[0]} cells at {self.cell!r} for {nf} frames (the frame index at {self.frames!r})"
                )
        if self.fractional:
            if cells is None:
                raise SpecError("fractional positions need the cell: give cell=... (a path into the batch)")
            pos = (pos.unsqueeze(-2) @ _cells_per_atom(cells, frame)).squeeze(-2)
        return Atoms(pos.detach(), frame, nf, None if cells is None else cells.detach())

    def moved(
        self, batch: Any, atoms: Atoms, positions: torch.Tensor, cells: torch.Tensor | None = None
    ) -> Any:
        """The batch with Cartesian ``positions`` ``(atoms, 3)`` (and ``cells``, in ``atoms.cells``'s
        layout) in place of its own, each written back in the batch's own layout."""
        out = batch
        if cells is not None:
            assert self.cell is not None
            out = replaced(out, self.cell, cells.reshape(get(batch, self.cell).shape))
        now = cells if cells is not None else atoms.cells
        pos = positions
        if self.fractional:
            assert now is not None
            pos = (pos.unsqueeze(-2) @ torch.linalg.inv(_cells_per_atom(now, atoms.frame))).squeeze(-2)
        out = replaced(out, self.positions, pos.reshape(get(batch, self.positions).shape))
        if self.rebuild is not None:
            moved = Atoms(positions, atoms.frame, atoms.frames, now)
            out = self.rebuild(out, moved)
        return out


def _cells_per_atom(cells: torch.Tensor, frame: torch.Tensor) -> torch.Tensor:
    return cells[frame] if cells.shape[0] > 1 else cells[0].expand(len(frame), 3, 3)


def _cells(cell: Any, path: Path) -> torch.Tensor:
    if not isinstance(cell, torch.Tensor) or cell.shape[-1:] != (3,):
        raise SpecError(
            f"cells at {path!r} must be (3, 3), (frames, 3, 3) or (3·frames, 3); found {_shape(cell)}"
        )
    if cell.dim() == 2 and cell.shape[0] % 3 == 0:
        return cell.reshape(-1, 3, 3)
    if cell.dim() == 3 and cell.shape[1] == 3:
        return cell
    raise SpecError(
        f"cells at {path!r} must be (3, 3), (frames, 3, 3) or (3·frames, 3); found {_shape(cell)}"
    )


def _shape(x: Any) -> str:
    return f"a tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"


def _keys(batch: Any) -> list[str]:
    if isinstance(batch, Mapping):
        return [str(k) for k in batch]
    keys = getattr(batch, "keys", None)
    if callable(keys):
        try:
            return [str(k) for k in keys()]
        except Exception:
            return []
    return []


def _not_found(what: str, path: Path, batch: Any) -> str:
    keys = _keys(batch)
    listed = f"; the batch has: {', '.join(keys)}" if keys else f" (the batch is a {type(batch).__name__})"
    return f"the physics check found no {what} at {path!r} in the batch{listed}"


def find_positions(batch: Any) -> str:
    """The first of ``POSITION_NAMES`` the batch has (a key or an attribute)."""
    for name in POSITION_NAMES:
        if isinstance(get_or_none(batch, name), torch.Tensor):
            return name
    raise SpecError(
        _not_found("positions", "|".join(POSITION_NAMES), batch)
        + ": name them, e.g. positions='g.frac_coords'"
    )


def find_cell(batch: Any) -> str | None:
    """The first of ``CELL_NAMES`` the batch has, or None (not periodic)."""
    return next((n for n in CELL_NAMES if isinstance(get_or_none(batch, n), torch.Tensor)), None)


def get_or_none(obj: Any, path: Path) -> Any:
    try:
        return get(obj, path)
    except LookupError:
        return None


def edge_vectors(
    out: Path = "edge_vec", index: Path = "edge_index", shift: Path | None = "cell_shift"
) -> Rebuild:
    """A ``rebuild`` for models that read edge vectors computed before the call (SevenNet's
    ``edge_vec``): ``pos[j] - pos[i] + shift @ cell`` for each edge ``(i, j)`` in ``index``, with
    ``shift`` the periodic image in cell vectors (ASE's ``neighbor_list('ijDS')``)."""

    def rebuild(batch: Any, atoms: Atoms) -> Any:
        i, j = get(batch, index)
        vec = atoms.positions[j] - atoms.positions[i]
        if shift is not None and atoms.cells is not None and has(batch, shift):
            s = get(batch, shift).to(vec.dtype)
            vec = vec + (s.unsqueeze(-2) @ _cells_per_atom(atoms.cells, atoms.frame)[i]).squeeze(-2)
        old = get(batch, out)
        return replaced(batch, out, vec.to(old.dtype) if isinstance(old, torch.Tensor) else vec)

    return rebuild


def dict_geometry(coord_key: str, box_key: str | None) -> Geometry:
    """The ``ProbeSpec``'s own layout: stacked frames under ``coord_key`` and ``box_key``."""
    return Geometry(positions=coord_key, cell=box_key, frames=None)


__all__ = ["Atoms", "Geometry", "dict_geometry", "edge_vectors", "get", "replaced"]
