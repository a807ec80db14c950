"""DeePMD-kit adapter (deepmd-kit 3.2, ``pt_expt`` backend): probe DeePMD's own uncompiled and compiled
training paths, term by term, through DeePMD's own switches.

    from gradprobe.adapters.deepmd import DeepmdAdapter
    from gradprobe import render
    adapter = DeepmdAdapter.from_config(config)          # a DeePMD input dict (or .from_trainer(trainer))
    fm = adapter.probe(diagnose=True)                     # uncompiled vs compiled, 4 scenarios
    print(render(fm))

What it does, and why:

- **Isolation** goes through DeePMD's label switches: ``find_energy`` / ``find_force`` / ``find_virial``
  are set to the probe's 0-dim weights (DeePMD multiplies each term's prefactor by them). A term the
  data has no labels for gets synthetic zero labels: for gradient *flow* only their presence matters.
  DeePMD loads no virial label at all when the virial prefactors are zero, so ``from_config`` turns
  them on (``start_pref_v = limit_pref_v = 1``) when both are zero, and says so in ``adapter.changes``.
- **Variants** ``deepmd:uncompiled`` (DeePMD's ``ModelWrapper`` around the model, as
  ``enable_compile: false`` trains) and ``deepmd:compiled`` (the same wrapper compiled by DeePMD's own
  ``Trainer._compile_model``: ``_CompiledModel``, ``make_fx`` of ``forward_lower``, detach stripping,
  ``torch.compile``), sharing the same parameter tensors and the same batch. Each build compiles a
  fresh wrapper: the user's trainer and its compiled graphs are never touched.
- **Proof that the compiled path ran**: DeePMD 3.2's ``_CompiledModel`` runs its eager original in eval
  mode, so the compiled configuration runs the wrapper in train mode and counts calls of the compiled
  graph; a measurement in which it did not run is recorded as a failure, not as a match.
- **Knobs** of ``deepmd:compiled`` (what the bisector flips): ``detach=strip|keep`` (DeePMD strips the
  ``aten.detach`` nodes ``make_fx`` records for saved tensors; ``keep`` skips that, the bug it
  guards against) and ``backend=inductor|aot_eager|eager`` (DeePMD compiles with inductor; the others
  rebuild DeePMD's last step, strip + rebuild + ``torch.compile``, with another backend).
- **Graph lint**: the traced ``forward_lower`` graph as it is compiled (after stripping) is kept, so
  ``makefx-detach`` can name the detach nodes left on parameter-dependent tensors.
- **Checks**: batches are dicts (``coord`` as ``(frames, atoms, 3)``, ``box`` as ``(frames, 3, 3)``, the
  labels under ``labels``) and ``spec_fields()`` gives the physics check DeePMD's energy, forces and
  virial; ``checks=["physics", "training", "balance"]`` work as for any spec.

Install: ``pip install 'gradprobe[deepmd]'``. DeePMD's prebuilt op library targets one torch release;
on another, build it from source against the installed torch (see the README).
"""

from __future__ import annotations

import contextlib
import copy
import re
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import torch

from ..build import Built, module_mode
from ..errors import SpecError
from ..flowmap import FlowMap
from ..rng import kept_rng
from ..variants import KnobTable
from .deepmd_checks import (
    FLOAT32_RTOLS,
    GRAD_RTOL,
    METRIC_DEFINITIONS,
    OUTPUT_RTOL,
    compare_backends,
    documented_metrics,
    metric_rtol,
    metrics_report,
    reported_metrics,
    serialized_grads,
)

TERMS = ("energy", "force", "virial")
_HAS = {"energy": "has_e", "force": "has_f", "virial": "has_v"}
ADAPTER_CHECKS = ("metrics", "backends")  # DeePMD's own checks, run by DeepmdAdapter.probe
COMPILED_KNOBS: KnobTable = {
    "detach": ("strip", ("strip", "keep")),
    "backend": ("inductor", ("inductor", "aot_eager", "eager")),
}
_STRIP_ADVICE = (
    "keep DeePMD's detach stripping on: _finalize_compiled_lower must call "
    "strip_saved_tensor_detach(traced, remove_all=True) before torch.compile (deepmd-kit >= 3.2 does; "
    "a patched or older compile path that skips it loses d(force)/d(params))"
)


_TYPE_ONE_SIDE_ADVICE = (
    "this se_e2_a descriptor has type_one_side: false, and DeePMD 3.2's compiled path sorts atoms by type "
    "with a data-dependent int() it cannot trace: set type_one_side: true in the descriptor (one embedding "
    "net per neighbour type), or train it uncompiled (training.enable_compile: false)"
)


def _require_deepmd() -> Any:
    try:
        import deepmd.pt_expt.train.training as training
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "the DeePMD-kit adapter needs deepmd-kit 3.2 with its pt_expt backend: "
            "pip install 'gradprobe[deepmd]' (see the README for building it against your torch)"
        ) from e
    return training


# --- a tiny synthetic system in DeePMD's npy layout -------------------------------------------


def write_synthetic_system(
    path: str | Path,
    *,
    natoms: int = 6,
    nframes: int = 2,
    type_map: Sequence[str] = ("O", "H"),
    box: float = 6.0,
    with_virial: bool = False,
    seed: int = 0,
) -> Path:
    """Write a small random periodic system DeePMD can train on: ``type.raw``, ``type_map.raw``,
    ``set.000/{coord,box,energy,force}.npy`` (and ``virial.npy`` with ``with_virial``). The labels are
    random: they serve gradient-flow probes, not physics. Returns the system's directory."""
    root = Path(path)
    (root / "set.000").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    types = np.arange(natoms) % len(type_map)
    (root / "type.raw").write_text("".join(f"{t}\n" for t in types))
    (root / "type_map.raw").write_text("".join(f"{t}\n" for t in type_map))
    coord = rng.uniform(0.0, box, size=(nframes, natoms * 3))
    np.save(root / "set.000" / "coord.npy", coord)
    np.save(root / "set.000" / "box.npy", np.tile((np.eye(3) * box).reshape(-1), (nframes, 1)))
    np.save(root / "set.000" / "energy.npy", rng.normal(size=nframes))
    np.save(root / "set.000" / "force.npy", rng.normal(size=(nframes, natoms * 3)))
    if with_virial:
        np.save(root / "set.000" / "virial.npy", rng.normal(size=(nframes, 9)))
    return root


def se_e2_a_config(
    systems: str | Path | Sequence[str | Path],
    *,
    type_map: Sequence[str] = ("O", "H"),
    precision: str = "float64",
    rcut: float = 4.0,
    seed: int = 1,
    workdir: str | Path | None = None,
) -> dict[str, Any]:
    """A small DeePMD ``se_e2_a`` energy-model input dict (energy, force and virial prefactors on)."""
    paths = [str(systems)] if isinstance(systems, (str, Path)) else [str(s) for s in systems]
    out = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="gradprobe-deepmd-"))
    return {
        "model": {
            "type_map": list(type_map),
            "descriptor": {
                "type": "se_e2_a",
                "sel": [24] * len(type_map),
                "rcut_smth": 0.5,
                "rcut": rcut,
                "neuron": [4, 8],
                "axis_neuron": 4,
                # type_one_side=false sorts atoms by type with a data-dependent int(): DeePMD 3.2's
                # compiled path cannot trace it (GuardOnDataDependentSymNode).
                "type_one_side": True,
                "precision": precision,
                "seed": seed,
            },
            "fitting_net": {"neuron": [8, 8], "precision": precision, "seed": seed},
        },
        "learning_rate": {"type": "exp", "start_lr": 1e-3, "stop_lr": 1e-5, "decay_steps": 100},
        "loss": {
            "type": "ener",
            "start_pref_e": 0.02,
            "limit_pref_e": 1.0,
            "start_pref_f": 1000.0,
            "limit_pref_f": 1.0,
            "start_pref_v": 1.0,
            "limit_pref_v": 1.0,
        },
        "training": {
            "training_data": {"systems": paths, "batch_size": 1},
            "numb_steps": 10,
            "seed": seed,
            "disp_file": str(out / "lcurve.out"),
            "save_ckpt": str(out / "model.ckpt"),
        },
    }


def adapter_from_input(path: str | Path) -> DeepmdAdapter:
    """A DeePMD input file (``dp --pt-expt train input.json``) as an adapter, for ``gradprobe run
    input.json``: data paths relative to the file, as DeePMD resolves them; DeePMD's own output files
    (lcurve, checkpoints) go to a temporary folder, not next to the input."""
    import json

    path = Path(path)
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SpecError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(config, dict) or "model" not in config or "training" not in config:
        raise SpecError(
            f"{path}: not a DeePMD input (no 'model' and 'training' sections); gradprobe run takes a DeePMD "
            "input.json or a Python spec file"
        )
    base = path.resolve().parent
    training = config["training"]
    for key in ("training_data", "validation_data"):
        data = training.get(key)
        if isinstance(data, dict) and "systems" in data:
            systems = data["systems"]
            listed = [systems] if isinstance(systems, str) else list(systems)
            data["systems"] = [str(s) if Path(s).is_absolute() else str(base / s) for s in listed]
    out = Path(tempfile.mkdtemp(prefix="gradprobe-deepmd-"))
    training["disp_file"] = str(out / "lcurve.out")
    training["save_ckpt"] = str(out / "model.ckpt")
    return DeepmdAdapter.from_config(config)


# --- the adapter ---------------------------------------------------------------------------------


class _CompiledCounter:
    """Counts calls of DeePMD's compiled graph (``executions``) and graphs dynamo compiled (``graphs``)."""

    def __init__(self) -> None:
        self.executions = 0
        self.graphs = 0
        self.traces = 0
        self.training: bool | None = None  # the wrapper's mode in the last call

    @property
    def fallback_message(self) -> str:
        """What happened when the compiled graph did not run, in the mode it did not run in."""
        if self.training is False:
            return (
                "DeePMD's compiled graph did not run: the wrapper was in eval mode, where _CompiledModel runs "
                "its eager original, so this run would measure eager against eager"
            )
        return (
            "DeePMD's compiled graph did not run in this train-mode call: _CompiledModel ran eager code "
            "instead (a dynamo fallback or a skipped frame), so this run would measure eager against eager"
        )


def _dynamo_graphs() -> int:
    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0


def _train_mode(module: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
    """DeePMD trains in train mode (forces with create_graph; the compiled graph only then)."""
    return module_mode(module, "train")


@contextlib.contextmanager
def _traced_with_source_lines() -> Iterator[None]:
    """DeePMD imports ``make_fx`` when it traces: have it record stack traces and module stacks, so
    the graph lint can name the DeePMD source line of a detach node. Tracing is otherwise unchanged."""
    import functools

    import torch.fx.experimental.proxy_tensor as proxy_tensor

    original = proxy_tensor.make_fx
    proxy_tensor.make_fx = functools.partial(original, record_stack_traces=True, record_module_stack=True)
    try:
        yield
    finally:
        proxy_tensor.make_fx = original


_FITTING_LAYER = re.compile(r"^(?P<net>.*fitting_net\.nets\._module_networks\.\d+)\.layers\.(?P<i>\d+)\.b$")


def _output_bias_notes(model: torch.nn.Module) -> dict[str, str]:
    """The fitting nets' output biases move every atom's energy by a per-type constant: no force or
    virial depends on them, so force-only and virial-only runs rightly leave them unreached."""
    last: dict[str, tuple[int, str]] = {}
    for name, _ in model.named_parameters():
        m = _FITTING_LAYER.match(name)
        if m and int(m["i"]) >= last.get(m["net"], (-1, ""))[0]:
            last[m["net"]] = (int(m["i"]), name)
    why = "output bias of a fitting net: a per-type energy constant, no force or virial depends on it"
    return {name: why for _, name in last.values()}


_PER_TYPE = re.compile(
    r"^(?P<net>.*(?P<kind>fitting_net\.nets|descriptor\.embeddings)\._module_networks\.(?P<t>\d+))\."
)


def _absent_type_notes(model: torch.nn.Module, atype: torch.Tensor) -> dict[str, str]:
    """Per-type networks (a fitting net per atom type; with ``type_one_side`` an embedding net per
    neighbour type) of the types with no atom in the batch: no loss term can reach them there."""
    try:
        type_map = list(model.get_type_map())  # type: ignore[operator]
    except Exception:
        return {}
    present = {int(t) for t in torch.unique(atype).tolist()}
    notes: dict[str, str] = {}
    for name, _ in model.named_parameters():
        m = _PER_TYPE.match(name)
        if m is None or int(m["t"]) in present or int(m["t"]) >= len(type_map):
            continue
        t = type_map[int(m["t"])]
        what = (
            "its fitting net"
            if m["kind"].startswith("fitting")
            else "the embedding net of neighbours of that type"
        )
        notes[m["net"]] = (
            f"type {t} is absent from the batch (types present: "
            f"{', '.join(type_map[i] for i in sorted(present) if i < len(type_map))}): {what} gets no gradient "
            "from it; probe a batch with every type to see it trained"
        )
    return notes


class DeepmdAdapter:
    """A DeePMD-kit ``pt_expt`` trainer seen through gradprobe's trainer protocol."""

    name = "deepmd"
    configurations: ClassVar[dict[str, KnobTable]] = {"uncompiled": {}, "compiled": COMPILED_KNOBS}

    def __init__(
        self,
        trainer: Any,
        *,
        terms: Sequence[str] | None = None,
        compile_options: Mapping[str, Any] | None = None,
        changes: Sequence[str] = (),
    ) -> None:
        self._training = _require_deepmd()
        if getattr(trainer, "multi_task", False):
            raise SpecError("the DeePMD adapter probes single-task trainers; probe each task's trainer")
        self.trainer = trainer
        self.model: torch.nn.Module = trainer.model  # the raw model (compilation only wraps it)
        self.loss_fn = trainer.loss
        available = [t for t in TERMS if getattr(self.loss_fn, _HAS[t], False)]
        if terms is None:
            terms = available
        off = [t for t in terms if t not in available]
        if off:
            raise SpecError(
                f"term(s) {', '.join(off)} have zero prefactors in this DeePMD loss, so DeePMD computes no "
                f"such term (and loads no labels for it); terms available: {', '.join(available)}"
            )
        if not terms:
            raise SpecError("this DeePMD loss has no energy, force or virial term to probe")
        self.terms = tuple(terms)
        self.changes = list(changes)
        self.cur_lr = float(trainer.scheduler.get_last_lr()[0])
        self.compile_options = dict(compile_options or {})  # training.compile_options (inductor options)
        self._batches: list[Any] = []
        self._notes: dict[str, str] = _output_bias_notes(self.model)
        self.metrics_by_default = True  # check_metrics in every probe (one forward)

    # construction -------------------------------------------------------------------------------

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        *,
        terms: Sequence[str] | None = None,
        enable_virial: bool = True,
    ) -> DeepmdAdapter:
        """Build a DeePMD trainer from an input dict (as ``dp --pt-expt train`` reads it) and adapt it.
        The input is copied; the compiled configuration takes ``training.compile_options`` from it."""
        _require_deepmd()
        from deepmd.pt_expt.entrypoints.main import get_trainer
        from deepmd.utils.argcheck import normalize
        from deepmd.utils.compat import update_deepmd_input

        cfg = copy.deepcopy(dict(config))
        changes = []
        loss = cfg.setdefault("loss", {})
        wants_virial = enable_virial and (terms is None or "virial" in terms)
        if wants_virial and not loss.get("start_pref_v") and not loss.get("limit_pref_v"):
            loss["start_pref_v"] = loss["limit_pref_v"] = 1.0
            changes.append(
                "virial prefactors were 0 (no virial term): set to 1 so the virial term can be probed"
            )
        compile_options = dict(cfg.get("training", {}).get("compile_options", {}) or {})
        cfg.setdefault("training", {})["enable_compile"] = False  # gradprobe compiles its own wrapper
        cfg = normalize(update_deepmd_input(cfg, warning=False), multi_task=False)
        return cls(get_trainer(cfg), terms=terms, compile_options=compile_options, changes=changes)

    @classmethod
    def from_trainer(
        cls,
        trainer: Any,
        *,
        terms: Sequence[str] | None = None,
        compile_options: Mapping[str, Any] | None = None,
    ) -> DeepmdAdapter:
        """Adapt an existing ``deepmd.pt_expt.train.training.Trainer`` (compiled or not; its own compiled
        graphs are not used or touched). One or two batches are drawn from its training data, so its
        data iterator moves on by that much."""
        return cls(trainer, terms=terms, compile_options=compile_options)

    # the protocol -----------------------------------------------------------------------------

    @property
    def notes(self) -> dict[str, str]:
        """Why parameters may get no gradient: the fitting nets' output biases, and the per-type
        networks of every type the probed batch has no atom of ("type H is absent from the batch")."""
        return {**self._notes, **_absent_type_notes(self.model, self.batch()["atype"])}

    def types_present(self) -> list[str]:
        """The type names of the atoms in the probed batch."""
        type_map = list(self.model.get_type_map())
        return [
            type_map[int(t)] for t in torch.unique(self.batch()["atype"]).tolist() if int(t) < len(type_map)
        ]

    def module(self) -> torch.nn.Module:
        return self.model

    def batch(self) -> Any:
        if not self._batches:
            self._batches.append(self._draw())
        return self._batches[0]

    def second_batch(self) -> Any:
        self.batch()
        if len(self._batches) < 2:
            self._batches.append(self._draw())
        return self._batches[1]

    def _draw(self) -> dict[str, Any]:
        with kept_rng():  # drawing a batch must not move the user's random streams
            inputs, labels = self.trainer.get_data(is_train=True)
        return self.as_batch(inputs, labels)

    @staticmethod
    def as_batch(inputs: Mapping[str, Any], labels: Mapping[str, Any]) -> dict[str, Any]:
        """DeePMD's ``(inputs, labels)`` as one dict: coordinates ``(frames, atoms, 3)`` and cells
        ``(frames, 3, 3)`` under ``coord`` / ``box`` (where gradprobe's physics check reads them), DeePMD's
        other inputs as they are, the labels under ``labels``."""
        batch = dict(inputs)
        nframes = inputs["atype"].shape[0]
        batch["coord"] = inputs["coord"].detach().reshape(nframes, -1, 3)
        if inputs.get("box") is not None:
            batch["box"] = inputs["box"].reshape(nframes, 3, 3)
        batch["labels"] = dict(labels)
        return batch

    @staticmethod
    def inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
        """The model's inputs in DeePMD's layout; coordinates a fresh leaf that requires grad (forces)."""
        out = {k: v for k, v in batch.items() if k != "labels"}
        nframes = out["atype"].shape[0]
        out["coord"] = out["coord"].reshape(nframes, -1).detach().requires_grad_(True)
        if out.get("box") is not None:
            out["box"] = out["box"].reshape(nframes, 9)
        return out

    def spec_fields(self) -> dict[str, Any]:
        """What the physics check needs: the energy per frame, and the model's own forces and virial."""

        def energy_fn(model: torch.nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
            with torch.enable_grad():  # DeePMD's forward takes autograd.grad for its forces
                return model(**self.inputs(batch))["energy"].reshape(-1).detach()

        def predict(model: torch.nn.Module, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
            nframes = batch["atype"].shape[0]
            out = model(**self.inputs(batch))
            return {
                "force": out["force"].reshape(nframes, -1, 3),
                "virial": out["virial"].reshape(nframes, 3, 3),
            }

        periodic = self.batch().get("box") is not None
        return {"energy_fn": energy_fn, "predict": predict, "coord_key": "coord",
                "box_key": "box" if periodic else None,
                "prefactor_schedule": self.prefactor_schedule()}  # fmt: skip

    def prefactor_schedule(self) -> dict[str, Any] | None:
        """DeePMD's loss prefactors now (at the trainer's current learning rate) and at the end of its
        schedule (``limit_pref_*``): pref = limit + (start - limit) * lr / start_lr."""
        loss = self.loss_fn
        start_lr = getattr(loss, "starter_learning_rate", None)
        if not start_lr:
            return None
        short = {"energy": "e", "force": "f", "virial": "v"}
        now, limit = {}, {}
        for t in self.terms:
            start, end = (
                getattr(loss, f"start_pref_{short[t]}", None),
                getattr(loss, f"limit_pref_{short[t]}", None),
            )
            if start is None or end is None:
                return None
            now[t] = float(end + (start - end) * self.cur_lr / start_lr)
            limit[t] = float(end)
        return {"now": now, "limit": limit, "step": f"the trainer's current step (lr {self.cur_lr:.3g})"}

    def labels(self, labels: Mapping[str, Any], weights: Mapping[str, torch.Tensor], inputs: Any) -> dict:
        """DeePMD's labels with each term's ``find_*`` switch set to its weight; synthetic zero labels
        for a probed term the data lacks."""
        out = dict(labels)
        coord = inputs["coord"]
        nframes = coord.shape[0]
        shapes = {"energy": (nframes, 1), "force": (nframes, coord.shape[-1]), "virial": (nframes, 9)}
        for t in self.terms:
            if t not in out:
                out[t] = torch.zeros(shapes[t], dtype=coord.dtype, device=coord.device)
            out[f"find_{t}"] = weights[t]
        return out

    def _wrapper(self, model: torch.nn.Module) -> torch.nn.Module:
        from deepmd.pt_expt.train.wrapper import ModelWrapper

        return ModelWrapper(model, self.loss_fn, matmul_precision=self.trainer.matmul_precision)

    def _call(
        self, wrapper: torch.nn.Module, batch: Any, weights: Mapping[str, torch.Tensor], counter: Any = None
    ) -> Any:
        """DeePMD's loss through ``wrapper`` in train mode: ``(loss, {}, metrics)``, the metrics being
        DeePMD's own ``more_loss`` (rmse_e, rmse_f, rmse_v, ...), recorded per run and path."""
        inputs = self.inputs(batch)
        with _train_mode(wrapper):
            if counter is not None:
                counter.training = wrapper.training
            _, loss, more = wrapper(
                **inputs, cur_lr=self.cur_lr, label=self.labels(batch["labels"], weights, inputs)
            )
        metrics = {k: v for k, v in (more or {}).items() if isinstance(v, torch.Tensor) and v.numel() == 1}
        return loss, {}, metrics

    def _outputs(self, wrapper: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """The path's energy per frame, forces and virial (for the physics check of that path)."""
        inputs = self.inputs(batch)
        nframes = inputs["atype"].shape[0]
        with _train_mode(wrapper):
            pred, _, _ = wrapper(**inputs, cur_lr=self.cur_lr, label=None)
        out = {"energy": pred["energy"].reshape(-1), "force": pred["force"].reshape(nframes, -1, 3)}
        if "virial" in pred:
            out["virial"] = pred["virial"].reshape(nframes, 3, 3)
        return out

    def loss(self, model: torch.nn.Module, batch: Any, weights: Mapping[str, torch.Tensor]) -> Any:
        """The uncompiled path: DeePMD's ``ModelWrapper`` (model + loss) in train mode, on ``model``:
        ``(loss, {}, DeePMD's metrics)``."""
        return self._call(self._wrapper(model), batch, weights)

    def build(
        self, configuration: str, knobs: Mapping[str, Any], model: torch.nn.Module | None = None
    ) -> Built:
        """DeePMD's compiled path on ``model`` (the probed model, or the copy a check trains)."""
        if configuration != "compiled":
            raise SpecError(f"DeePMD adapter: unknown configuration {configuration!r}")
        training = self._training
        training.check_compile_torch_version()
        detach = knobs.get("detach", COMPILED_KNOBS["detach"][0])
        backend = knobs.get("backend", COMPILED_KNOBS["backend"][0])
        wrapper = self._wrapper(self.model if model is None else model)
        # DeePMD's own compile step, on a fresh wrapper: what enable_compile does in Trainer.__init__.
        stand_in = SimpleNamespace(
            wrapper=wrapper,
            model_keys=list(self.trainer.model_keys),
            _shared_links=getattr(self.trainer, "_shared_links", None),
            compile_infer=False,
            multi_task=False,
        )
        training.Trainer._compile_model(stand_in, self.compile_options)
        counter = _CompiledCounter()
        advice = {"makefx-detach": _STRIP_ADVICE}
        descriptor = getattr(getattr(self.model, "atomic_model", None), "descriptor", None)
        if getattr(descriptor, "type_one_side", None) is False:
            advice["data-dependent-trace"] = _TYPE_ONE_SIDE_ADVICE
        built = Built(counter=counter, graph_params=0, advice=advice)
        built.notes.append(f"DeePMD compiled path: detach={detach}, backend={backend}")
        finalize = self._finalize(training, detach, backend, counter, built)

        @contextlib.contextmanager
        def compiling() -> Iterator[None]:  # DeePMD compiles lazily, on the first call
            original = training._finalize_compiled_lower
            training._finalize_compiled_lower = finalize
            try:
                with _traced_with_source_lines():
                    yield
            finally:
                training._finalize_compiled_lower = original

        def run(batch: Any, weights: Mapping[str, torch.Tensor]) -> Any:
            with compiling():
                return self._call(wrapper, batch, weights, counter)

        def predict(batch: Any) -> dict[str, torch.Tensor]:
            with compiling():
                return self._outputs(wrapper, batch)

        built.run, built.predict = run, predict
        return built

    @staticmethod
    def _finalize(training: Any, detach: str, backend: str, counter: _CompiledCounter, built: Built) -> Any:
        """A stand-in for DeePMD's ``_finalize_compiled_lower`` (called once, on the lazy first trace):
        the original (inductor) or its three steps with another backend, with the detach knob
        applied, the compiled graph kept for the lint, and its calls counted."""
        original_finalize = training._finalize_compiled_lower
        original_strip = training._strip_saved_tensor_detach
        original_rebuild = training._rebuild_graph_module

        def rebuild(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
            built.graph = original_rebuild(gm)
            return built.graph

        def no_strip(gm: torch.fx.GraphModule, *, remove_all: bool = False) -> None:
            del gm, remove_all

        def finalize(traced: torch.fx.GraphModule, compile_opts: Any, extra_options: Any = None) -> Any:
            counter.traces += 1
            training._rebuild_graph_module = rebuild
            if detach == "keep":
                training._strip_saved_tensor_detach = no_strip
            try:
                if backend == "inductor":
                    compiled = original_finalize(traced, compile_opts, extra_options)
                else:
                    training._strip_saved_tensor_detach(traced, remove_all=True)
                    gm = training._rebuild_graph_module(traced)
                    training.apply_global_compile_patches()
                    compiled = torch.compile(gm, backend=backend, dynamic=True)
            finally:
                training._rebuild_graph_module = original_rebuild
                training._strip_saved_tensor_detach = original_strip

            def counted(*args: Any, **kwargs: Any) -> Any:
                before = _dynamo_graphs()
                counter.executions += 1
                try:
                    return compiled(*args, **kwargs)
                finally:
                    counter.graphs += _dynamo_graphs() - before

            return counted

        return finalize

    # DeePMD's metrics, recomputed; the pt backend ---------------------------------------------

    def _all_on(self, batch: Any, inputs: Mapping[str, Any]) -> dict[str, Any]:
        one = torch.tensor(1.0, dtype=torch.float64)
        return self.labels(batch["labels"], dict.fromkeys(self.terms, one), inputs)

    def check_metrics(self, batch: Any = None) -> dict[str, Any]:
        """DeePMD's reported metrics (``more_loss``: rmse_e, rmse_f, rmse_v, rmse) against gradprobe's
        recomputation from the same call's outputs and labels by DeePMD's documented definitions
        (``documented_metrics``), every probed term switched on. ``fm.checks["metrics"]`` of ``probe()``;
        a metric off by a factor is named ``norm-mismatch`` with the factor."""
        batch = self.batch() if batch is None else batch
        inputs = self.inputs(batch)
        labels = self._all_on(batch, inputs)
        wrapper = self._wrapper(self.model)
        with _train_mode(wrapper):
            pred, _, more = wrapper(**inputs, cur_lr=self.cur_lr, label=labels)
        natoms = int(inputs["atype"].shape[-1])
        return metrics_report({"pt_expt": (reported_metrics(more), documented_metrics(pred, labels, natoms,
                              self._loss_settings()))}, natoms, int(inputs["atype"].shape[0]),
                              metric_rtol(self.model))  # fmt: skip

    def _loss_settings(self) -> dict[str, Any]:
        """What the aggregate ``rmse`` needs: the loss's prefactors now, its normalisation, and whether
        its options stay within the documented MSE definition."""
        loss = self.loss_fn
        data = loss.serialize() if hasattr(loss, "serialize") else {}
        start_lr = data.get("starter_learning_rate")
        prefs: dict[str, float] = {}
        short = {"energy": "e", "force": "f", "virial": "v"}
        for t in TERMS:  # every term the loss computes, probed or not: the aggregate rmse holds them all
            start, limit = data.get(f"start_pref_{short[t]}"), data.get(f"limit_pref_{short[t]}")
            if start_lr and start is not None and limit is not None and (start or limit):
                prefs[t] = float(limit + (start - limit) * self.cur_lr / start_lr)
        return {"prefactors": prefs, "serialized": data}

    def compare_backends(self, batch: Any = None) -> dict[str, Any]:
        """DeePMD's ``pt`` backend against ``pt_expt`` on the same weights and batch: the model moved by
        ``serialize()``/``deserialize()``, energy, forces and virial compared at 1e-10 of their scale,
        the gradients of each term (gradprobe's own mean squared error against the labels, the same
        function on both) per serialized variable at 1e-8, and each backend's reported metrics against
        the documented definitions. ``fm.checks["backends"]`` of ``probe(checks=["backends"])``; a
        failure is named ``backends-differ``. The probed model is not touched (a copy is measured)."""
        return compare_backends(self, self.batch() if batch is None else batch)

    # convenience ------------------------------------------------------------------------------

    def probe(
        self,
        *,
        configurations: Sequence[str] | None = None,
        detach: str | None = None,
        backend: str | None = None,
        diagnose: bool = False,
        checks: Sequence[str] = (),
        metrics: bool = True,
        **spec_fields: Any,
    ) -> FlowMap:
        """Probe uncompiled vs compiled (``detach``/``backend`` set the compiled path's knobs).

        Besides gradprobe's checks, ``checks`` takes DeePMD's own: ``"backends"`` (``compare_backends``:
        pt vs pt_expt, into ``fm.checks["backends"]``). ``metrics`` (on by default, one forward) adds
        ``check_metrics``: DeePMD's reported rmse against the documented definitions."""
        from ..trainer import probe_trainer

        knobs = {k: v for k, v in (("detach", detach), ("backend", backend)) if v is not None}
        default, self.metrics_by_default = self.metrics_by_default, metrics
        try:
            return probe_trainer(
                self,
                configurations=configurations,
                knobs={"compiled": knobs},
                diagnose=diagnose,
                checks=checks,
                **spec_fields,
            )
        finally:
            self.metrics_by_default = default

    own_checks = ADAPTER_CHECKS

    def add_own_checks(self, fm: FlowMap, checks: Sequence[str]) -> FlowMap:
        """The map with DeePMD's own checks added (``checks["metrics"]``: always, unless
        ``metrics_by_default`` is off and it is not asked for; ``checks["backends"]`` when asked for) and
        its findings read again from the whole evidence. ``probe_trainer`` (and so ``gradprobe run
        input.json --check backends``) calls it. A check that raises is recorded as one that could not run."""
        import importlib

        import msgspec

        added: dict[str, Any] = {}
        metrics = self.metrics_by_default or "metrics" in checks
        for name, on, run in (
            ("metrics", metrics, self.check_metrics),
            ("backends", "backends" in checks, self.compare_backends),
        ):
            if not on:
                continue
            try:
                with kept_rng(), torch.enable_grad():
                    added[name] = run()
            except Exception as e:
                added[name] = {"passed": False, "error": f"{type(e).__name__}: {e}"}
        if not added:
            return fm
        fm = msgspec.structs.replace(fm, checks={**fm.checks, **added})
        diagnose = importlib.import_module("gradprobe.diagnose").diagnose  # by name: wrappers see it
        return msgspec.structs.replace(fm, findings=tuple(diagnose(fm)))


__all__ = [
    "ADAPTER_CHECKS",
    "COMPILED_KNOBS",
    "FLOAT32_RTOLS",
    "GRAD_RTOL",
    "METRIC_DEFINITIONS",
    "OUTPUT_RTOL",
    "TERMS",
    "DeepmdAdapter",
    "adapter_from_input",
    "compare_backends",
    "documented_metrics",
    "metrics_report",
    "se_e2_a_config",
    "serialized_grads",
    "write_synthetic_system",
]
