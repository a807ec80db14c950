"""MACE adapter (mace-torch 0.3.16, e3nn 0.4.4): probe MACE's own compile path (``mace.tools.compile.prepare``
then ``torch.compile``) against the eager model, term by term, with MACE's own loss functions.

    from gradprobe.adapters.mace import MaceAdapter
    from gradprobe import render
    adapter = MaceAdapter.tiny()                      # a small synthetic periodic system and model
    # or MaceAdapter(create_model, batch)             # your model factory and a batch dict (to_dict())
    fm = adapter.probe(backend="aot_eager")
    print(render(fm))

What it does, and why:

- **The compiled path is MACE's**: ``prepare(factory)`` builds a fresh model without e3nn's code
  generation and simplifies it with ``torch.fx``, and sets dynamo's ``trace_autograd_ops`` (forces by
  ``autograd.grad`` traced into the graph); the adapter then points every parameter of that model at the
  probed model's parameter of the same name (buffers are copied), and compiles it as MACE's tests and
  users do (``torch.compile(model, fullgraph=True)``). Gradients land on the probed parameters.
- **Terms from MACE's loss**: ``energy`` is ``energy_weight · weighted_mean_squared_error_energy`` and
  ``force`` is ``forces_weight · mean_squared_error_forces`` (MACE's ``WeightedEnergyForcesLoss``,
  whose sum they are); the probe's 0-dim weights multiply them.
- **Knob** ``backend=inductor|aot_eager|eager`` of ``mace:compile`` (MACE compiles with inductor).
- **Global state**: ``prepare`` flips dynamo config and registers ``autograd.grad`` as allowed in the
  graph for the whole process; the probe restores the configs around every variant.

Install: ``pip install mace-torch==0.3.16`` (it pins e3nn 0.4.4, which NequIP 0.19's e3nn 0.6 excludes:
use its own environment). MACE must be imported before e3nn 0.4.4 loads its constants on torch >= 2.6
(MACE sets ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``); this module imports it first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch

from ..build import Built
from ..errors import SpecError
from ..flowmap import FlowMap
from ..variants import KnobTable

TERMS = ("energy", "force")
COMPILE_KNOBS: KnobTable = {"backend": ("inductor", ("inductor", "aot_eager", "eager"))}


def _require_mace() -> Any:
    try:
        import mace  # before e3nn: MACE sets TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD for e3nn 0.4.4's constants
        import mace.tools.compile
    except ImportError as e:  # pragma: no cover - exercised only without the package
        raise ImportError("the MACE adapter needs mace-torch 0.3.16: pip install mace-torch==0.3.16") from e
    return mace


def tiny_factory(*, seed: int = 0, r_max: float = 2.5) -> Callable[[], torch.nn.Module]:
    """A factory of one-interaction ``ScaleShiftMACE`` models (H, O; ``4x0e + 4x1o``; float64 weights
    when the default dtype is float64), the same weights on every call."""
    _require_mace()
    import numpy as np
    import torch.nn.functional as F  # noqa: N812 (MACE spells it so)
    from e3nn import o3
    from mace import modules, tools

    def create() -> torch.nn.Module:
        tools.torch_geometric.seed_everything(seed)
        block = modules.interaction_classes["RealAgnosticResidualInteractionBlock"]
        return modules.ScaleShiftMACE(
            r_max=r_max, num_bessel=4, num_polynomial_cutoff=5, max_ell=1, interaction_cls=block,
            interaction_cls_first=block, num_interactions=1, num_elements=2,
            hidden_irreps=o3.Irreps("4x0e + 4x1o"), MLP_irreps=o3.Irreps("4x0e"), gate=F.silu,
            atomic_energies=np.array([0.0, 0.0]), avg_num_neighbors=8, atomic_numbers=[1, 8],
            correlation=2, radial_type="bessel", atomic_inter_scale=1.0, atomic_inter_shift=0.0,
        )  # fmt: skip

    return create


def synthetic_batch(*, atoms: int = 5, box: float = 3.0, r_max: float = 2.5, seed: int = 0) -> dict[str, Any]:
    """One random periodic H/O frame with random energy and force labels, through MACE's own data
    pipeline (``config_from_atoms``, ``AtomicData.from_config``, its loader), as a dict."""
    _require_mace()
    import numpy as np
    from ase import Atoms
    from mace import data, tools

    g = np.random.default_rng(seed)
    frame = Atoms(numbers=([1, 8] * atoms)[:atoms], positions=g.uniform(0, box, (atoms, 3)), cell=[box] * 3,
                  pbc=True)  # fmt: skip
    frame.info["REF_energy"] = float(g.normal())
    frame.arrays["REF_forces"] = g.normal(size=(atoms, 3))
    config = data.config_from_atoms(frame)
    table = tools.AtomicNumberTable([1, 8])
    loader = tools.torch_geometric.dataloader.DataLoader(
        dataset=[data.AtomicData.from_config(config, z_table=table, cutoff=r_max)], batch_size=1
    )
    return dict(next(iter(loader)).to_dict())


def share_parameters(target: torch.nn.Module, source: torch.nn.Module) -> None:
    """Point every parameter of ``target`` at ``source``'s parameter of the same name; copy the buffers
    both have. Raises when a parameter has no counterpart (another architecture)."""
    probed = dict(source.named_parameters())
    missing = [n for n, _ in target.named_parameters() if n not in probed]
    if missing:
        raise SpecError(
            f"MACE adapter: the prepared model has parameters the probed model lacks ({', '.join(missing[:4])}): "
            "the factory must build the probed model's architecture"
        )
    for name, _ in list(target.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        (target.get_submodule(owner) if owner else target)._parameters[leaf] = probed[name]
    buffers = dict(source.named_buffers())
    with torch.no_grad():
        for name, b in target.named_buffers():
            if name in buffers and buffers[name].shape == b.shape:
                b.copy_(buffers[name])


class _Fields(dict):  # type: ignore[type-arg]
    """A batch dict whose fields also read as attributes, as MACE's torch_geometric ``Batch`` does."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class MaceAdapter:
    """A MACE model factory and batch seen through gradprobe's trainer protocol."""

    name = "mace"
    configurations: ClassVar[dict[str, KnobTable]] = {"eager": {}, "compile": COMPILE_KNOBS}

    def __init__(
        self,
        factory: Callable[[], torch.nn.Module],
        batch: Mapping[str, Any],
        *,
        model: torch.nn.Module | None = None,
        energy_weight: float = 1.0,
        forces_weight: float = 1.0,
        terms: Sequence[str] = TERMS,
        fullgraph: bool = True,
    ) -> None:
        _require_mace()
        unknown = [t for t in terms if t not in TERMS]
        if unknown:
            raise SpecError(
                f"MACE adapter: unknown term(s) {', '.join(unknown)}; terms are: {', '.join(TERMS)}"
            )
        self.factory = factory
        self.model = model if model is not None else factory()
        self._batch = dict(batch)
        self.weights = {"energy": energy_weight, "force": forces_weight}
        self.terms = tuple(terms)
        self.fullgraph = fullgraph

    @classmethod
    def tiny(cls, *, seed: int = 0) -> MaceAdapter:
        """A tiny MACE model (float64) on one random periodic frame of five atoms."""
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)  # MACE builds and loads data in the default dtype
        try:
            return cls(tiny_factory(seed=seed), synthetic_batch(seed=seed))
        finally:
            torch.set_default_dtype(previous)

    # the protocol -------------------------------------------------------------------------------

    def module(self) -> torch.nn.Module:
        return self.model

    def batch(self) -> Any:
        return self._batch

    def terms_of(self, model: Any, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """MACE's energy and force losses on ``model``'s predictions (training mode, forces by autograd)."""
        from mace.modules.loss import mean_squared_error_forces, weighted_mean_squared_error_energy

        pred = model(dict(batch), training=True, compute_force="force" in self.terms, compute_stress=False)
        ref = _Fields(batch)  # MACE's losses read the batch's fields as items and as attributes (ref.ptr)
        out = {}
        if "energy" in self.terms:
            out["energy"] = self.weights["energy"] * weighted_mean_squared_error_energy(ref, pred, ddp=False)
        if "force" in self.terms:
            out["force"] = self.weights["force"] * mean_squared_error_forces(ref, pred, ddp=False)
        return out

    def _weighted(self, model: Any, batch: Any, weights: Mapping[str, torch.Tensor]) -> Any:
        terms = self.terms_of(model, batch)
        return sum(weights[t] * terms[t] for t in self.terms), terms

    def loss(self, model: torch.nn.Module, batch: Any, weights: Mapping[str, torch.Tensor]) -> Any:
        """The eager path: the model as built by the factory, MACE's losses."""
        return self._weighted(model, batch, weights)

    def build(self, configuration: str, knobs: Mapping[str, Any], model: torch.nn.Module) -> Built:
        """MACE's ``prepare(factory)`` model on ``model``'s parameters, compiled."""
        if configuration != "compile":
            raise SpecError(f"MACE adapter: unknown configuration {configuration!r}")
        from mace.tools.compile import prepare

        backend = knobs.get("backend", COMPILE_KNOBS["backend"][0])
        dtype = next(model.parameters()).dtype
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            prepared = prepare(self.factory)()
        finally:
            torch.set_default_dtype(previous)
        share_parameters(prepared, model)
        compiled = torch.compile(prepared, backend=backend, fullgraph=self.fullgraph)
        built = Built()
        built.notes.append(f"MACE prepare + torch.compile(fullgraph={self.fullgraph}), backend={backend}")
        built.run = lambda batch, weights: self._weighted(compiled, batch, weights)
        return built

    def probe(self, *, backend: str | None = None, diagnose: bool = False, checks: Sequence[str] = (),
              **spec_fields: Any) -> FlowMap:  # fmt: skip
        """Probe eager vs MACE's compile path (``backend`` sets the compile path's knob)."""
        from ..trainer import probe_trainer

        knobs = {"compile": {"backend": backend}} if backend is not None else None
        return probe_trainer(self, knobs=knobs, diagnose=diagnose, checks=checks, **spec_fields)


__all__ = ["COMPILE_KNOBS", "TERMS", "MaceAdapter", "share_parameters", "synthetic_batch", "tiny_factory"]
