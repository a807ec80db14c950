"""Any machine-learned interatomic potential, with no package-specific code (issue 33): a model that
maps a batch to energies and, by autograd inside or outside it, forces and stress, probed with the
energy, force and stress terms of a standard loss or of the package's own, and checked by the physics
check on the package's own batches (PyG ``Data``/``Batch``, dicts, tuples), with no reshaping.

    from gradprobe.adapters.potential import PotentialAdapter, Stress
    adapter = PotentialAdapter(model, batch, energy="energy", forces="forces", stress="stress",
                               labels={"energy": "y_energy", "force": "y_forces"})
    fm = adapter.probe(variants="eager,compile_model:aot_eager", checks=["physics"])

What goes where:

* **The call**: ``call(model, batch)``, by default ``model(batch)`` on a shallow copy of the batch (a
  model that writes its outputs into the batch it is given leaves yours as it was). Its outputs (a dict,
  a PyG ``Data``, a tuple) are read by path: ``energy``, ``forces`` and ``stress`` each name a key, an
  attribute or an index (``"energy"``, ``0``, ``"out.energy"``), or are functions of the outputs.
* **Energies** one per frame. **Forces** ``(atoms, 3)``, the model's own; ``forces=None``: the adapter
  takes them as ``-dE/dx`` by ``autograd.grad(create_graph=True)`` outside the model (Cartesian
  positions only). **Stress** in the ASE convention, ``(1/V) dE/d(strain)`` in eV/Å³, as ``(frames, 3,
  3)``, ``(3·frames, 3)`` or Voigt ``(frames, 6)`` (``xx yy zz yz xz xy``); another sign, unit or Voigt
  order is declared with ``Stress(path, scale=..., order=...)`` (SevenNet's ``Stress(key, scale=-1,
  order="xx yy zz xy yz zx")``, matgl's GPa ``Stress(2, scale=1 / 160.21766208)``).
* **The atoms**, for the physics check and the per-atom normalisation: ``positions`` (a path; by
  default the first of ``pos``, ``positions``, ``R``, ... the batch has), ``cell`` (a path, None: not
  periodic), ``frames`` (the per-atom frame index; by default ``batch`` next to the positions),
  ``fractional`` (matgl's ``frac_coords``) and ``rebuild`` for what the batch computed from the
  positions before the call (``gradprobe.geometry.edge_vectors``: SevenNet's ``edge_vec``).
* **The terms**. The standard loss (``loss=None``), each term times its ``weights`` entry (default 1):
  ``energy`` = mean over frames of ``((E - E_label) / atoms)²`` (``energy_loss="per_atom"``, the
  default) or ``(E - E_label)²`` (``"per_frame"``); ``force`` = mean over atoms and components of
  ``(F - F_label)²``; ``stress`` = mean over the model's stress components of ``(S - S_label)²``, in its
  own units and layout. Labels are paths into the batch (``labels={"energy": "y", "force": "neg_dy"}``);
  a term without one is taken against zeros (gradient flow does not depend on label values; the
  training check then drives the outputs to zero). The package's own loss: ``loss(outputs, batch)``
  returning ``{term: value}``, or only the total: then each output's term is the total with every
  *other* output replaced by its label (its part of the loss is then zero, whatever the loss is), and
  what no output explains is the term ``other``.

``describe()`` says all of it in words; ``spec()`` gives the ``ProbeSpec`` (terms mode, ``energy_fn``,
``predict`` and ``geometry`` for the physics check); ``probe()`` runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import SpecError
from ..geometry import Geometry, Path, Rebuild, find_cell, find_positions, get, get_or_none, replaced, shallow

ASE_VOIGT = "xx yy zz yz xz xy"
EV_PER_A3_IN_GPA = 160.21766208  # 1 eV/Å³ in GPa
TERMS = ("energy", "force", "stress")
Selector = Path | Callable[[Any], torch.Tensor]


@dataclass(frozen=True)
class Stress:
    """Where a model's stress is, and how it relates to the ASE convention: ``scale · S`` is the ASE
    stress ``(1/V) dE/d(strain)`` in eV/Å³ (``scale=-1``: the opposite sign; ``1 / 160.21766208``: GPa);
    ``order``: the Voigt order of a ``(frames, 6)`` stress."""

    at: Selector
    scale: float = 1.0
    order: str = ASE_VOIGT


def _read(outputs: Any, selector: Selector) -> torch.Tensor:
    return selector(outputs) if callable(selector) else get(outputs, selector)


def _as_matrix(s: torch.Tensor, frames: int, order: str) -> torch.Tensor:
    """A stress of any layout as ``(frames, 3, 3)``."""
    if s.numel() == frames * 9:
        return s.reshape(frames, 3, 3)
    if s.numel() == frames * 6:
        index = {"xx": (0, 0), "yy": (1, 1), "zz": (2, 2), "yz": (1, 2), "xz": (0, 2), "xy": (0, 1),
                 "zy": (2, 1), "zx": (2, 0), "yx": (1, 0)}  # fmt: skip
        v = s.reshape(frames, 6)
        m = v.new_zeros(frames, 3, 3)
        for k, name in enumerate(order.split()):
            a, b = index[name]
            m[:, a, b] = v[:, k]
            m[:, b, a] = v[:, k]
        return m
    raise SpecError(f"a stress of {s.numel()} values for {frames} frames: expected 9 or 6 per frame")


class PotentialAdapter:
    """A potential and its batch seen as a gradprobe spec (see the module's docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        batch: Any,
        *,
        call: Callable[[torch.nn.Module, Any], Any] | None = None,
        energy: Selector = "energy",
        forces: Selector | None = "forces",
        stress: Selector | Stress | None = None,
        positions: Path | None = None,
        cell: Path | type[Ellipsis] | None = ...,
        frames: Path | None = None,
        fractional: bool = False,
        rebuild: Rebuild | None = None,
        labels: Mapping[str, Path] | None = None,
        loss: Callable[[Any, Any], Any] | None = None,
        weights: Mapping[str, float] | None = None,
        energy_loss: str = "per_atom",
        terms: Sequence[str] | None = None,
        second_batch: Any = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise SpecError(f"PotentialAdapter: model must be an nn.Module, got {type(model).__name__}")
        if energy_loss not in ("per_atom", "per_frame"):
            raise SpecError(f"energy_loss must be 'per_atom' or 'per_frame', got {energy_loss!r}")
        self.model, self.batch, self.second_batch = model, batch, second_batch
        self._call = call
        self.energy, self.forces, self.energy_loss, self.loss = energy, forces, energy_loss, loss
        self._other: bool | None = None  # whether a total-only loss has a part no output explains
        self.stress = stress if isinstance(stress, Stress) or stress is None else Stress(stress)
        positions = positions if positions is not None else find_positions(batch)
        parent = str(positions).rpartition(".")[0]
        if frames is None:
            frames = f"{parent}.batch" if parent else "batch"
        if cell is ...:  # a cell next to the positions, or at the top of the batch
            inner = find_cell(get(batch, parent)) if parent else None
            cell = f"{parent}.{inner}" if inner else find_cell(batch)
        self.geometry = Geometry(positions, cell, frames, fractional, rebuild)  # type: ignore[arg-type]
        self.labels = dict(labels or {})
        unknown = [t for t in self.labels if t not in TERMS]
        if unknown:
            raise SpecError(f"labels: unknown term {unknown[0]!r}; terms are: {', '.join(TERMS)}")
        available = ["energy", "force"] + (["stress"] if self.stress is not None else [])
        chosen = list(terms) if terms is not None else available
        missing = [t for t in chosen if t not in available]
        if missing:
            raise SpecError(f"the potential has no {missing[0]} output; its terms: {', '.join(available)}")
        self.terms = tuple(chosen)
        self.weights = {t: float((weights or {}).get(t, 1.0)) for t in self.terms}
        if forces is None and fractional:
            raise SpecError(
                "forces=None (taken by autograd) needs Cartesian positions; name the model's forces"
            )
        self.geometry.read(batch)  # positions, cells and frames that cannot be found fail here

    # what the model gives ------------------------------------------------------------------------

    def run(self, model: torch.nn.Module, batch: Any) -> tuple[Any, dict[str, torch.Tensor]]:
        """The model's outputs as it returns them, and ``{"energy", "force", "stress"}`` read from them
        (energies ``(frames,)``, forces ``(atoms, 3)``, stress as the model gives it)."""
        x = None
        if self.forces is None:  # -dE/dx by autograd, on a leaf put in place of the positions
            x = get(batch, self.geometry.positions).detach().clone().requires_grad_(True)
            batch = replaced(batch, self.geometry.positions, x)
        outputs = self._call(model, batch) if self._call is not None else model(shallow(batch))
        read = {"energy": _read(outputs, self.energy).reshape(-1)}
        if self.forces is not None:
            read["force"] = _read(outputs, self.forces)
        else:
            assert x is not None
            (grad,) = torch.autograd.grad(read["energy"].sum(), x, create_graph=True)
            read["force"] = -grad.reshape(-1, 3)
        if self.stress is not None:
            read["stress"] = _read(outputs, self.stress.at)
        return outputs, read

    def energy_fn(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """Energies per frame, for the physics check's finite differences."""
        return self.run(model, batch)[1]["energy"]

    def predict(self, model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """``{"energy", "force", "virial"}`` in gradprobe's convention (virial = -V · ASE stress)."""
        _, read = self.run(model, batch)
        out = {"energy": read["energy"], "force": read["force"].reshape(-1, 3)}
        atoms = self.geometry.read(batch)
        if self.stress is not None and atoms.cells is not None:
            s = _as_matrix(read["stress"], atoms.frames, self.stress.order) * self.stress.scale
            volume = torch.linalg.det(atoms.cells.to(s.dtype)).abs()
            out["virial"] = -s * (volume if len(volume) > 1 else volume.expand(atoms.frames)).reshape(
                -1, 1, 1
            )
        return out

    # the terms -------------------------------------------------------------------------------------

    def terms_of(self, model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """The loss terms of one step (terms mode): the standard loss, or the package's own."""
        outputs, read = self.run(model, batch)
        if self.loss is None:
            return self._standard(read, batch)
        value = self.loss(outputs, batch)
        if isinstance(value, Mapping):
            return dict(value)
        return self._split(outputs, batch, value)

    def _label(self, batch: Any, term: str, like: torch.Tensor) -> torch.Tensor:
        path = self.labels.get(term)
        if path is None:
            return torch.zeros_like(like).detach()
        label = get_or_none(batch, path)
        if not isinstance(label, torch.Tensor):
            raise SpecError(f"no {term} label at {path!r} in the batch")
        return label.to(like.dtype).reshape(like.shape)

    def _atoms_per_frame(self, batch: Any, frames: int) -> torch.Tensor:
        """Atoms in each frame, with shapes that do not depend on the data (a traced step stays
        traceable: no ``bincount``, no ``.item()``)."""
        pos = get(batch, self.geometry.positions)
        if pos.dim() == 3:
            return torch.full((frames,), pos.shape[1], device=pos.device)
        index = get_or_none(batch, self.geometry.frames) if self.geometry.frames is not None else None
        if not isinstance(index, torch.Tensor):
            index = torch.zeros(len(pos), dtype=torch.long, device=pos.device)
        return torch.zeros(frames, device=pos.device).index_add(
            0, index, torch.ones(len(pos), device=pos.device)
        )

    def _standard(self, read: Mapping[str, torch.Tensor], batch: Any) -> dict[str, torch.Tensor]:
        out = {}
        for t in self.terms:
            pred = read[t]
            diff = pred - self._label(batch, t, pred)
            if t == "energy" and self.energy_loss == "per_atom":
                diff = diff / self._atoms_per_frame(batch, len(diff)).to(diff.dtype)
            out[t] = self.weights[t] * diff.pow(2).mean()
        return out

    def _split(self, outputs: Any, batch: Any, total: torch.Tensor) -> dict[str, torch.Tensor]:
        """A loss that returns only its total, split into terms: the term of one output is the loss with
        every other output replaced by its label (their parts then vanish), ``other`` the rest."""
        where = {
            "energy": self.energy,
            "force": self.forces,
            "stress": self.stress.at if self.stress else None,
        }
        if any(callable(where[t]) or where[t] is None for t in self.terms) or set(self.labels) < set(
            self.terms
        ):
            raise SpecError(
                "the loss returns only its total: to split it into terms the adapter needs each output as a "
                "path (not a function) and each term's label (labels={...}); or return {term: value}"
            )
        out = {}
        for t in self.terms:
            others = outputs
            for u in self.terms:
                if u != t:
                    pred = get(outputs, where[u])  # type: ignore[arg-type]
                    label = get(batch, self.labels[u]).to(pred.dtype).reshape(pred.shape)
                    others = replaced(others, where[u], label)  # type: ignore[arg-type]
            out[t] = self.loss(others, batch)  # type: ignore[misc]
        rest = total - sum(out.values())
        if self._other is None and not _tracing():  # decided once, eagerly: a traced step has no float()
            self._other = float(rest.detach().abs()) > 1e-6 * max(float(total.detach().abs()), 1e-30)
        if self._other:
            out["other"] = rest
        return out

    # the spec -------------------------------------------------------------------------------------

    def spec(self, **fields: Any) -> Any:
        """The ``ProbeSpec``: terms mode with ``terms_of``, and the physics check's ``energy_fn``,
        ``predict`` and ``geometry``; ``fields`` override or add (``optimizer``, ``notes``...)."""
        from ..spec import ProbeSpec

        values: dict[str, Any] = {
            "model": self.model, "step": self.terms_of, "batch": self.batch, "mode": "terms",
            "second_batch": self.second_batch, "energy_fn": self.energy_fn, "predict": self.predict,
            "geometry": self.geometry, "name": "potential: " + self.describe().splitlines()[0],
        }  # fmt: skip
        values.update(fields)
        return ProbeSpec(**values)

    def probe(self, variants: str | Sequence[Any] = "eager", *, checks: Sequence[str] = (),
              diagnose: bool = False, **fields: Any) -> Any:  # fmt: skip
        """``gradprobe.probe`` of ``spec(**fields)``; the flow map's ``evidence["potential"]`` holds
        ``describe()``'s statements."""
        import msgspec

        from ..probe import probe

        fm = probe(self.spec(**fields), variants=variants, checks=list(checks), diagnose=diagnose)
        return msgspec.structs.replace(
            fm, evidence={**fm.evidence, "potential": self.describe().splitlines()}
        )

    def describe(self) -> str:
        """The terms, their normalisation, labels and weights, and where the atoms are, in words."""
        g = self.geometry
        if self.loss is not None:
            terms = "the package's own loss"
        else:
            per = {"per_atom": "per atom", "per_frame": "per frame"}[self.energy_loss]
            parts = {
                "energy": f"energy MSE of the energy {per}",
                "force": "force MSE over atoms and components",
                "stress": "stress MSE over the model's stress components",
            }
            terms = "standard loss: " + "; ".join(
                f"{parts[t]} × {self.weights[t]:g} against "
                + (f"the label at {self.labels[t]!r}" if t in self.labels else "zeros (no label given)")
                for t in self.terms
            )
        forces = (
            "the model's own forces"
            if self.forces is not None
            else "forces -dE/dx by autograd outside the model"
        )
        atoms = (
            f"atoms: positions at {g.positions!r}{' (fractional)' if g.fractional else ''}, frames by {g.frames!r}, "
            + (f"cells at {g.cell!r}" if g.cell is not None else "not periodic")
            + ("; what the batch computed from them rebuilt for each move" if g.rebuild is not None else "")
        )
        stress = (
            f"; stress × {self.stress.scale:g} is the ASE stress in eV/Å³ (Voigt {self.stress.order})"
            if self.stress is not None
            else ""
        )
        return f"{terms}\n{forces}{stress}\n{atoms}"


def _tracing() -> bool:
    """Inside make_fx or dynamo, where a tensor's value cannot be read."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return get_proxy_mode() is not None or torch.compiler.is_compiling()


def with_forces_scaled(model: torch.nn.Module, factor: float, forces: Path) -> Any:
    """A fault for tests and examples: a forward hook that scales the forces the model returns at
    ``forces`` (a key, an attribute or an index of its outputs) by ``factor``; returns the handle
    (``.remove()`` takes the fault away)."""

    def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
        return replaced(output, forces, factor * get(output, forces))

    return model.register_forward_hook(hook)


__all__ = ["ASE_VOIGT", "EV_PER_A3_IN_GPA", "PotentialAdapter", "Stress", "with_forces_scaled"]
