"""NequIP adapter (nequip 0.19): probe NequIP's own training-time compile path (``compile_mode="compile"``,
``CompileGraphModel``) against its eager ``GraphModel``, term by term, with NequIP's own loss.

    from gradprobe.adapters.nequip import NequipAdapter
    from gradprobe import render
    adapter = NequipAdapter.tiny()                  # a small synthetic periodic system and model
    # or NequipAdapter(model, batch, loss)          # your GraphModel, an AtomicDataDict, a MetricsManager
    fm = adapter.probe(backend="aot_eager", diagnose=True)
    print(render(fm))

What it does, and why:

- **Terms from NequIP's loss**: the loss is NequIP's ``MetricsManager`` (``EnergyForceStressLoss`` by
  default); each of its coefficient-weighted entries is one term (``energy`` from ``per_atom_energy_mse``
  or ``total_energy_mse``, ``force`` from ``forces_mse``, ``stress`` from ``stress_mse``), and the
  reference loss is their weighted sum as NequIP's ``weighted_sum`` computes it, each term multiplied
  by the probe's 0-dim weight.
- **Variants** ``nequip:eager`` (the ``GraphModel`` as given) and ``nequip:compile`` (NequIP's own
  ``CompileGraphModel`` around the *same* inner network: ``nequip_make_fx`` of the model with its
  ``autograd.grad`` forces traced into plain ops, then ``torch.compile`` of that first-order graph). Both
  share the parameter tensors, so gradients land on the probed parameters.
- **Knob** of ``nequip:compile``: ``backend=inductor|aot_eager|eager``. NequIP calls ``torch.compile``
  without a backend (inductor); the adapter passes the chosen backend to that one call while NequIP
  compiles (about a minute cold for inductor on 2 cores; CI uses ``aot_eager``).
- **Global state**: NequIP builds models only after ``nequip.utils.global_state.set_global_state()``
  and runs with what it sets (float64 default dtype; dynamo's ``capture_scalar_outputs`` and
  ``capture_dynamic_output_shape_ops``). :meth:`NequipAdapter.tiny` calls it, as NequIP's own entry points
  do, but gives the caller's settings, configs and random states back; the adapter applies NequIP's
  settings around NequIP's code only (model, loss, compile: ``nequip_settings()``). NequIP's Lightning
  module also sets ``torch._functorch.config.donated_buffer = False``; the adapter does not (its
  compiled path's backward is first order, and flipping donation against a shared inductor cache gave
  silently wrong gradients).

Install: ``pip install nequip`` (0.19; pulls e3nn 0.6).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch

from ..build import Built
from ..errors import SpecError
from ..flowmap import FlowMap
from ..variants import KnobTable

TERMS = ("energy", "force", "stress")
COMPILE_KNOBS: KnobTable = {"backend": ("inductor", ("inductor", "aot_eager", "eager"))}
# NequIP's loss entries -> gradprobe's term names (by the metric's name in MetricsManager).
_TERM_OF = (("energy", "energy"), ("forces", "force"), ("stress", "stress"), ("virial", "virial"))


def _require_nequip() -> Any:
    try:
        import nequip
    except ImportError as e:  # pragma: no cover - exercised only without the package
        raise ImportError("the NequIP adapter needs nequip 0.19: pip install nequip") from e
    return nequip


def term_of(metric_name: str) -> str | None:
    """``per_atom_energy_mse`` -> ``energy``; ``forces_mse`` -> ``force``; None for other metrics."""
    return next((term for key, term in _TERM_OF if key in metric_name), None)


def synthetic_batch(
    *, frames: int = 2, atoms: int = 5, types: int = 2, box: float = 3.0, r_max: float = 2.5, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A batched ``AtomicDataDict`` of small random periodic frames with random energy, force and stress
    labels (for gradient flow, not physics), its neighbour list built by NequIP."""
    _require_nequip()
    from nequip.data import AtomicDataDict, compute_neighborlist_, from_dict

    out = []
    with nequip_settings():  # NequIP's data layer reads the default dtype
        for f in range(frames):
            g = torch.Generator().manual_seed(seed + f)
            dtype = torch.get_default_dtype()
            data = from_dict(
                {
                    "pos": torch.rand(atoms, 3, generator=g, dtype=dtype) * box,
                    "cell": torch.eye(3, dtype=dtype) * box,
                    "pbc": True,
                    "atom_types": torch.arange(atoms) % types,
                    "total_energy": torch.randn(1, generator=g, dtype=dtype),
                    "forces": torch.randn(atoms, 3, generator=g, dtype=dtype),
                    "stress": torch.randn(1, 3, 3, generator=g, dtype=dtype),
                }
            )
            out.append(compute_neighborlist_(data, r_max=r_max))
        return AtomicDataDict.batched_from_list(out)


def tiny_model(
    type_names: Sequence[str] = ("H", "O"), *, r_max: float = 2.5, seed: int = 0
) -> torch.nn.Module:
    """A one-layer NequIP GNN (l_max 1, 4 features), float64, eager (``compile_mode="eager"``)."""
    _require_nequip()
    from nequip.model import NequIPGNNModel

    return NequIPGNNModel(seed=seed, model_dtype="float64", r_max=r_max, type_names=list(type_names),
                          num_layers=1, l_max=1, num_features=4, radial_mlp_width=8,
                          avg_num_neighbors=9.0)  # fmt: skip


@contextlib.contextmanager
def nequip_settings() -> Iterator[None]:
    """What NequIP's ``set_global_state()`` sets for its code, inside only: its default dtype (float64)
    and, on torch >= 2.6, dynamo's ``capture_dynamic_output_shape_ops`` and ``capture_scalar_outputs``
    (NequIP assumes dynamic shapes when it compiles); the caller's settings are restored after."""
    import torch._dynamo.config as dynamo_config
    from nequip.utils.dtype import torch_default_dtype
    from nequip.utils.global_state import _GLOBAL_DTYPE

    saved = dynamo_config.capture_dynamic_output_shape_ops, dynamo_config.capture_scalar_outputs
    dynamo_config.capture_dynamic_output_shape_ops = dynamo_config.capture_scalar_outputs = True
    try:
        with torch_default_dtype(_GLOBAL_DTYPE):
            yield
    finally:
        dynamo_config.capture_dynamic_output_shape_ops, dynamo_config.capture_scalar_outputs = saved


@contextlib.contextmanager
def compile_backend(backend: str) -> Iterator[None]:
    """``torch.compile`` calls without a backend (NequIP's) use ``backend`` while inside."""
    original = torch.compile

    @functools.wraps(original)
    def with_backend(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("backend", backend)
        return original(*args, **kwargs)

    torch.compile = with_backend  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = original  # type: ignore[assignment]


class NequipAdapter:
    """A NequIP ``GraphModel`` and loss seen through gradprobe's trainer protocol."""

    name = "nequip"
    configurations: ClassVar[dict[str, KnobTable]] = {"eager": {}, "compile": COMPILE_KNOBS}

    def __init__(
        self,
        model: torch.nn.Module,
        batch: Mapping[str, torch.Tensor],
        loss: Any = None,
        *,
        terms: Sequence[str] | None = None,
        second_batch: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        _require_nequip()
        from nequip.nn.compile import CompileGraphModel

        if isinstance(model, CompileGraphModel):
            raise SpecError(
                "NequIP adapter: give it the eager GraphModel (compile_mode='eager'); its compile path is "
                "built by the adapter on the same parameters"
            )
        if loss is None:
            from nequip.train import EnergyForceStressLoss

            type_names = list(getattr(model, "type_names", None) or [])
            if not type_names:
                raise SpecError(
                    "NequIP adapter: this model records no type names, so the default loss cannot be built: "
                    "pass loss=EnergyForceStressLoss(type_names=[...]) (or your own MetricsManager)"
                )
            loss = EnergyForceStressLoss(type_names=type_names)
        self.model = model
        self.loss_fn = loss
        self._batch = dict(batch)
        self._second = dict(second_batch) if second_batch is not None else None
        self._entries = {
            name: term_of(name)
            for name, entry in loss.entries.items()
            if entry.coeff is not None and term_of(name) is not None
        }
        available = list(dict.fromkeys(t for t in self._entries.values() if t is not None))
        chosen = list(terms) if terms is not None else available
        missing = [t for t in chosen if t not in available]
        if missing:
            raise SpecError(
                f"NequIP loss has no weighted entry for {', '.join(missing)}; it has: {', '.join(available)}"
            )
        self.terms = tuple(chosen)

    @classmethod
    def tiny(cls, *, seed: int = 0, terms: Sequence[str] | None = None) -> NequipAdapter:
        """A tiny NequIP model on two random periodic frames of five atoms, with NequIP's
        ``EnergyForceStressLoss`` (sets NequIP's global state first, as NequIP's entry points do)."""
        _require_nequip()
        from nequip.train import EnergyForceStressLoss
        from nequip.utils.global_state import set_global_state

        from ..state import isolated_settings

        # set_global_state seeds everything, sets float64 and flips dynamo config process-wide: the
        # caller gets all of it back (the adapter applies NequIP's settings around NequIP's code only).
        with isolated_settings(import_configs=True):
            set_global_state()
            return cls(tiny_model(seed=seed), synthetic_batch(seed=seed),
                       EnergyForceStressLoss(type_names=["H", "O"]), terms=terms,
                       second_batch=synthetic_batch(seed=seed + 10))  # fmt: skip

    # the protocol -------------------------------------------------------------------------------

    def module(self) -> torch.nn.Module:
        return self.model

    def batch(self) -> Any:
        return self._batch

    def second_batch(self) -> Any:
        return self._second if self._second is not None else self._batch

    def terms_of(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """NequIP's loss on ``model``'s predictions, as coefficient-weighted terms (they sum to NequIP's
        ``weighted_sum``)."""
        with nequip_settings():
            out = model(dict(batch))
            metrics = self.loss_fn(out, dict(batch))
        terms: dict[str, torch.Tensor] = {}
        for name, term in self._entries.items():
            if term in self.terms:
                value = metrics[name] * self.loss_fn.entries[name].coeff
                terms[term] = terms[term] + value if term in terms else value
        return terms

    def _weighted(self, model: torch.nn.Module, batch: Any, weights: Mapping[str, torch.Tensor]) -> Any:
        terms = self.terms_of(model, batch)
        total = sum(weights[t] * terms[t] for t in self.terms)
        return total, terms

    def loss(self, model: torch.nn.Module, batch: Any, weights: Mapping[str, torch.Tensor]) -> Any:
        """The eager path: the ``GraphModel`` and NequIP's loss, ``(total, {term: value})``."""
        return self._weighted(model, batch, weights)

    def build(self, configuration: str, knobs: Mapping[str, Any], model: torch.nn.Module) -> Built:
        """NequIP's ``CompileGraphModel`` around ``model``'s inner network (shared parameters)."""
        if configuration != "compile":
            raise SpecError(f"NequIP adapter: unknown configuration {configuration!r}")
        from nequip.nn.compile import CompileGraphModel

        backend = knobs.get("backend", COMPILE_KNOBS["backend"][0])
        inner = model.model  # type: ignore[attr-defined]
        with nequip_settings():
            compiled = CompileGraphModel(inner, model_input_fields=dict(inner.irreps_in))
        built = Built()
        built.notes.append(f"NequIP CompileGraphModel (nequip_make_fx + torch.compile), backend={backend}")

        def run(batch: Any, weights: Mapping[str, torch.Tensor]) -> Any:
            with compile_backend(backend), nequip_settings():  # NequIP compiles lazily, on the first call
                return self._weighted(compiled, batch, weights)

        built.run = run
        return built

    # convenience --------------------------------------------------------------------------------

    def probe(self, *, backend: str | None = None, diagnose: bool = False, checks: Sequence[str] = (),
              **spec_fields: Any) -> FlowMap:  # fmt: skip
        """Probe eager vs NequIP's compile path (``backend`` sets the compile path's knob)."""
        from ..trainer import probe_trainer

        knobs = {"compile": {"backend": backend}} if backend is not None else None
        return probe_trainer(self, knobs=knobs, diagnose=diagnose, checks=checks, **spec_fields)


__all__ = ["COMPILE_KNOBS", "TERMS", "NequipAdapter", "synthetic_batch", "term_of", "tiny_model"]
