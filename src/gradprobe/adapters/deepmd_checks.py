"""DeePMD-kit's own checks, for ``DeepmdAdapter`` (``adapters/deepmd.py``): its reported metrics
(``rmse_e``, ``rmse_f``, ``rmse_v``, ``rmse``) recomputed by DeePMD's documented definitions, never by
its loss code, and its ``pt`` backend against ``pt_expt`` on the same weights (``serialize()`` /
``deserialize()``). Imported by the adapter; needs deepmd-kit only when a check runs."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..build import module_mode

if TYPE_CHECKING:
    from .deepmd import DeepmdAdapter

# --- DeePMD's metrics by their documented definitions ------------------------------------------

# What DeePMD documents (``dp test`` prints "Energy RMSE/Natoms" and "Virial RMSE/Natoms"; the energy
# loss's docstring gives the prefactor schedule and the 1/N (legacy) or 1/N² (``intensive_ener_virial``)
# scaling of the energy and virial terms). Recomputed here from outputs and labels, never by DeePMD's loss.
METRIC_DEFINITIONS = {
    "rmse_e": "sqrt(mean over frames of (E - E_label)^2) / natoms",
    "rmse_f": "sqrt(mean over frames, atoms and x/y/z of (F - F_label)^2)",
    "rmse_v": "sqrt(mean over frames and the 9 components of (V - V_label)^2) / natoms",
    "rmse": "sqrt(p_e mse_e / natoms^k + p_f mse_f + p_v mse_v / natoms^k), p = limit + (start - limit) lr / "
    "start_lr, k = 1 (2 with intensive_ener_virial)",
}
_TERM_OF = {"rmse_e": "energy", "rmse_f": "force", "rmse_v": "virial"}
# Loss options outside the documented MSE definition of the aggregate rmse: it is then not recomputed.
_NON_MSE = ("use_huber", "relative_f", "f_use_norm", "enable_atom_ener_coeff")
_OTHER_TERMS = ("ae", "pf", "gf", "h")


def _mse(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().to(torch.float64), b.detach().to(torch.float64)
    return float(torch.mean((a.reshape(a.shape[0], -1) - b.reshape(b.shape[0], -1)) ** 2))


def documented_metrics(
    pred: Mapping[str, torch.Tensor],
    labels: Mapping[str, Any],
    natoms: int,
    settings: Mapping[str, Any] | None = None,
) -> dict[str, float | str]:
    """DeePMD's rmse metrics by their documented definitions (``METRIC_DEFINITIONS``), from a model's
    outputs (``energy`` per frame, ``force``, ``virial``) and the labels: ``rmse_e`` and ``rmse_v`` per
    atom (divided by ``natoms``), ``rmse_f`` per component. ``settings`` (the loss's serialized options
    and its prefactors now) add the aggregate ``rmse``; where the loss uses options beyond the documented
    MSE (Huber, MAE, relative forces, other terms) the value is a string saying why it is not recomputed."""
    out: dict[str, float | str] = {}
    mse: dict[str, float] = {}
    for term in _TERM_OF.values():
        if term in pred and labels.get(term) is not None:
            mse[term] = _mse(pred[term], labels[term])
    if "energy" in mse:
        out["rmse_e"] = math.sqrt(mse["energy"]) / natoms
    if "force" in mse:
        out["rmse_f"] = math.sqrt(mse["force"])
    if "virial" in mse:
        out["rmse_v"] = math.sqrt(mse["virial"]) / natoms
    if settings is not None:
        data = settings.get("serialized") or {}
        prefs = settings.get("prefactors") or {}
        beyond = [k for k in _NON_MSE if data.get(k)] + [
            f"pref_{t}" for t in _OTHER_TERMS if data.get(f"start_pref_{t}") or data.get(f"limit_pref_{t}")
        ]
        if data.get("loss_func", "mse") != "mse":
            beyond.append(f"loss_func={data['loss_func']}")
        if beyond or not prefs:
            out["rmse"] = "not recomputed: " + (
                f"the loss uses {', '.join(beyond)}, beyond the documented MSE" if beyond else "no prefactors"
            )
        else:
            k = 2 if data.get("intensive_ener_virial") else 1
            scale = {"energy": natoms**-k, "force": 1.0, "virial": natoms**-k}
            # A term counts where its label is there (DeePMD's find_* switch): it multiplies the prefactor.
            found = {t: float(labels.get(f"find_{t}", 1.0)) for t in prefs}
            out["rmse"] = math.sqrt(sum(prefs[t] * found[t] * mse[t] * scale[t] for t in prefs if t in mse))
    return out


def reported_metrics(more: Mapping[str, Any] | None) -> dict[str, float]:
    return {
        k: float(v.detach()) if isinstance(v, torch.Tensor) else float(v)
        for k, v in (more or {}).items()
        if (isinstance(v, torch.Tensor) and v.numel() == 1) or isinstance(v, (int, float))
    }


def metric_rtol(model: torch.nn.Module) -> float:
    """Float noise of a recomputed metric: sums in another order, and normalisation constants DeePMD
    may hold in float32 (its pt backend's per-frame ``1/natoms`` from the float32 ``mask``, squared, puts its rmse_e and
    rmse_v 3.7e-8 above the definition on a float64 model; measured on 3.2.0)."""
    dtype = next((p.dtype for p in model.parameters()), torch.float64)
    return 1e-6 if dtype == torch.float64 else 1e-4


def metrics_report(
    paths: Mapping[str, tuple[Mapping[str, float], Mapping[str, float | str]]],
    natoms: int,
    nframes: int,
    rtol: float,
) -> dict[str, Any]:
    """Per path (a backend), per metric: DeePMD's reported value, gradprobe's recomputed one, their
    ratio (``factor``) and whether they agree within ``rtol`` (``fm.checks["metrics"]``)."""
    out: dict[str, Any] = {"natoms": natoms, "nframes": nframes, "rtol": rtol,
                           "definitions": dict(METRIC_DEFINITIONS), "paths": {}, "not_recomputed": {}}  # fmt: skip
    passed = True
    for path, (reported, ours) in paths.items():
        rows: dict[str, Any] = {}
        for metric, value in ours.items():
            if isinstance(value, str):
                out["not_recomputed"][metric] = value
                continue
            got = reported.get(metric)
            if got is None or not math.isfinite(got):
                continue  # not reported (a term the loss does not compute)
            factor = got / value if value else (1.0 if got == 0.0 else math.inf)
            ok = abs(got - value) <= rtol * max(abs(value), abs(got))
            passed &= ok
            rows[metric] = {"reported": got, "recomputed": value, "factor": factor, "passed": ok}
        out["paths"][path] = rows
    out["passed"] = passed
    return out


# --- the pt backend against pt_expt: weights moved by serialize()/deserialize() ------------------------

OUTPUT_RTOL = 1e-10  # float64; a float32 model: FLOAT32_RTOLS
GRAD_RTOL = 1e-8
FLOAT32_RTOLS = (1e-5, 1e-3)  # outputs, gradients: float32 arithmetic summed in another order
_GRAD_FLOOR = 1e-6  # of a term's largest gradient: the scale under which a variable's error is measured


def _leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}/{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)) and any(
        isinstance(v, (Mapping, list, tuple, np.ndarray)) for v in tree
    ):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{prefix}/{i}")
    elif isinstance(tree, np.ndarray) and tree.dtype.kind == "f":
        yield prefix, tree.copy()  # serialize() may hand out views of the parameters' storage


def serialized_grads(model: torch.nn.Module, grads: Sequence[torch.Tensor | None]) -> dict[str, np.ndarray]:
    """Gradients of ``model``'s trainable parameters laid out as its ``serialize()`` lays out its
    weights: the parameters are set to the gradients, serialized, and put back. Variables that hold no
    parameter (statistics, buffers) are left out: those are found by serializing parameters set to NaN."""
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        saved = [p.detach().clone() for p in params]
        try:
            for p in params:
                p.fill_(math.nan)
            marked = dict(_leaves(model.serialize()))
            for p, g in zip(params, grads, strict=True):
                p.copy_(torch.zeros_like(p) if g is None else g)
            values = dict(_leaves(model.serialize()))
        finally:
            for p, v in zip(params, saved, strict=True):
                p.copy_(v)
    return {k: np.array(v, dtype=np.float64) for k, v in values.items() if np.isnan(marked.get(k, 0.0)).any()}


def _outputs_of(model: torch.nn.Module, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    nframes = inputs["atype"].shape[0]
    with module_mode(model, "train"):
        out = model(inputs["coord"], inputs["atype"], box=inputs.get("box"))
    got = {"energy": out["energy"].reshape(nframes, 1), "force": out["force"].reshape(nframes, -1, 3)}
    if "virial" in out:
        got["virial"] = out["virial"].reshape(nframes, 9)
    return got


def _term_grads(
    model: torch.nn.Module, out: Mapping[str, torch.Tensor], labels: Mapping[str, Any], terms: Sequence[str]
) -> dict[str, dict[str, np.ndarray]]:
    """Per term, the gradient of gradprobe's own mean squared error of that output against its label,
    per serialized variable."""
    params = [p for p in model.parameters() if p.requires_grad]
    raw = {}
    for t in terms:
        if t not in out:
            continue
        label = torch.as_tensor(labels[t], dtype=out[t].dtype).reshape(out[t].shape)
        loss = torch.mean((out[t] - label) ** 2)
        raw[t] = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    # Serialized only once every gradient is taken: serializing sets the parameters in place.
    return {t: serialized_grads(model, g) for t, g in raw.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().to(torch.float64), b.detach().to(torch.float64)
    scale = float(b.abs().max())
    diff = float((a - b).abs().max())
    return diff / scale if scale > 0 else diff


def _pt_labels(labels: Mapping[str, Any]) -> dict[str, Any]:
    """The labels in the layout the pt backend's data loader gives them: forces ``(frames, atoms, 3)``."""
    out = dict(labels)
    if isinstance(out.get("force"), torch.Tensor):
        out["force"] = out["force"].reshape(out["force"].shape[0], -1, 3)
    return out


def compare_backends(adapter: DeepmdAdapter, batch: Any) -> dict[str, Any]:
    """``DeepmdAdapter.compare_backends``: pt_expt (a copy of the probed model) against pt
    (``deserialize()`` of its ``serialize()``) on ``batch``."""
    from deepmd.pt.loss import EnergyStdLoss
    from deepmd.pt.model.model import BaseModel as PtModel

    reference = copy.deepcopy(adapter.model)
    other = PtModel.deserialize(adapter.model.serialize())  # pt's class for the serialized model type
    inputs = adapter.inputs(batch)
    labels = adapter._all_on(batch, inputs)
    natoms = int(inputs["atype"].shape[-1])
    double = next((p.dtype for p in adapter.model.parameters()), torch.float64) == torch.float64
    out_rtol, grad_rtol = (OUTPUT_RTOL, GRAD_RTOL) if double else FLOAT32_RTOLS
    result: dict[str, Any] = {"reference": "pt_expt", "other": "pt", "via": "serialize()/deserialize()",
                              "rtol_outputs": out_rtol, "rtol_grads": grad_rtol, "natoms": natoms}  # fmt: skip
    outs = {"pt_expt": _outputs_of(reference, inputs), "pt": _outputs_of(other, adapter.inputs(batch))}
    result["outputs"] = {
        k: _rel(outs["pt"][k], outs["pt_expt"][k]) for k in outs["pt_expt"] if k in outs["pt"]
    }
    terms = [t for t in adapter.terms if t in outs["pt_expt"]]
    gref = _term_grads(reference, outs["pt_expt"], labels, terms)
    goth = _term_grads(other, outs["pt"], labels, terms)
    grads: dict[str, Any] = {}
    unmatched: set[str] = set()
    for t in terms:
        a, b = goth[t], gref[t]
        unmatched |= set(a) ^ set(b)
        scale = max((float(np.abs(v).max()) for v in b.values() if v.size), default=0.0)
        floor = _GRAD_FLOOR * scale if scale > 0 else 1.0
        per = {}
        for k in sorted(set(a) & set(b)):
            if a[k].shape != b[k].shape:
                per[k] = math.inf
                continue
            per[k] = (
                float(np.abs(a[k] - b[k]).max() / max(float(np.abs(b[k]).max()), floor)) if b[k].size else 0.0
            )
        worst = max(per, key=per.__getitem__) if per else None
        grads[t] = {"max_rel_error": per[worst] if worst else 0.0, "worst": worst, "variables": per,
                    "scale": scale}  # fmt: skip
    result["grads"] = grads
    result["unmatched"] = sorted(unmatched)
    # Each backend's own loss reports its metrics; both against the documented definitions.
    settings = adapter._loss_settings()
    with module_mode(reference, "train"):
        wrapper = adapter._wrapper(reference)
        pred_expt, _, more_expt = wrapper(**adapter.inputs(batch), cur_lr=adapter.cur_lr, label=labels)
    pt_loss = EnergyStdLoss(**{k: v for k, v in settings["serialized"].items() if not k.startswith("@")})
    pt_inputs = adapter.inputs(batch)
    with module_mode(other, "train"):
        pred_pt, _, more_pt = pt_loss(
            {k: pt_inputs[k] for k in ("coord", "atype", "box") if pt_inputs.get(k) is not None},
            other, _pt_labels(labels), natoms, adapter.cur_lr,
        )  # fmt: skip
    result["metrics"] = metrics_report(
        {"pt_expt": (reported_metrics(more_expt), documented_metrics(pred_expt, labels, natoms, settings)),
         "pt": (reported_metrics(more_pt), documented_metrics(pred_pt, labels, natoms, settings))},
        natoms, int(inputs["atype"].shape[0]), metric_rtol(adapter.model),
    )  # fmt: skip
    failures = [f"{k}: pt differs from pt_expt by {e:.3g} of its scale" for k, e in result["outputs"].items()
                if not e <= out_rtol]  # fmt: skip
    failures += [f"{t} gradient: {g['worst']} differs by {g['max_rel_error']:.3g}" for t, g in grads.items()
                 if not g["max_rel_error"] <= grad_rtol]  # fmt: skip
    if unmatched:
        failures.append(f"serialized variables trainable in one backend only: {', '.join(sorted(unmatched))}")
    result["failures"] = failures
    result["passed"] = not failures
    return result
