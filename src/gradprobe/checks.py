"""Verification: the checks that say a fix is done.

* ``consistency_report``: every variant's gradients and term values against the reference, judged as
  the flow map's cells are (relative L1 error per parameter, the run's noise floor) at a tighter rtol
  (float64 reaches 1e-10), worst offenders by name — from the probe's own measurements.
* ``physics_check``: for potentials, forces against minus central finite differences of the energy,
  the force sum rule, and the virial against the strain derivative (and its symmetry). Catches ghost
  forces sliced instead of scatter-summed, which leave gradient counts unchanged.
* ``training_check``: a few optimizer steps per variant and term on a deep copy; does each term's loss
  go down, and do compiled trajectories follow eager's?

Shape sweeps (other batch shapes) are measured in ``probe.py`` next to the second-batch check.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .build import VariantContext, build
from .compare import NOISE_FLOOR, consistency_tolerance, judge, noise_floor, noise_pairs, tolerance
from .copies import model_copy
from .errors import SpecError
from .measure import isolated, run_error
from .optim import fresh_optimizer
from .progress import stage
from .rng import reseed
from .scenarios import Scenario
from .spec import ProbeSpec
from .step import check_total, make_weights
from .variants import VariantSpec

# Physics tolerances (float64): relative to the force / virial scale.
FORCE_RTOL = 1e-6
SUM_RULE_RTOL = 1e-8
VIRIAL_RTOL = 1e-6


def consistency_report(
    names: Sequence[str],
    measured: Sequence[Any],
    reference: Mapping[str, Any],
    ref_name: str,
    dtype: str,
    numels: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Each path's gradients and term values against the reference's, per (scenario, parameter).

    One tolerance story with the flow map's cells: a parameter is judged on the relative L1 error of
    its gradient against the reference's gradient of that parameter, with the reference run's noise
    floor (``compare.judge``). A cell fails when the table's verdict (at ``compare.tolerance``) is
    missing, extra or wrong — so this check never passes where the table shows a difference — or when
    both gradients are real and differ beyond the tighter ``compare.consistency_tolerance`` by more
    than the noise floor per element (float64: 1e-10 between correct paths). NaN or Inf on either
    side fails. A term value fails beyond that rtol of its reference value plus the noise floor of the
    run's largest term."""
    numels = list(numels) if numels is not None else [1] * len(names)
    floor_of = NOISE_FLOOR.get(dtype, 1e-5)
    out: dict[str, Any] = {
        "rtol": consistency_tolerance(dtype),
        "table_rtol": tolerance(dtype),
        "noise_floor": floor_of,
        "variants": {},
    }
    for x in measured:
        if x.info.name == ref_name:
            continue
        autocast = x.info.knobs.get("autocast", "off")
        rtol, table_rtol = consistency_tolerance(dtype, autocast), tolerance(dtype, autocast)
        failed: list[dict[str, Any]] = []
        terms: list[dict[str, Any]] = []
        checked = 0
        for m in x.results:
            ref = reference.get(m.scenario)
            if m.error is not None or ref is None or ref.error is not None:
                continue
            failed += _inconsistent(m, ref, names, numels, dtype, rtol, table_rtol)
            checked += sum(e is not None for e in m.rel_errors or ())
            terms += _terms_off(m, ref, rtol, floor_of)
        failed.sort(key=lambda f: -_size(f["rel_error"]))
        terms.sort(key=lambda t: -_size(t["rel_error"]))
        runs_failed = sum(m.error is not None for m in x.results)
        entry = {
            "passed": not failed and not terms and runs_failed == 0 and checked > 0,
            "checked_cells": checked,
            "failed_cells": len(failed),
            "worst": failed[:10],
            "terms": terms[:10],
            "runs_failed": runs_failed,
        }
        if autocast != "off":
            entry.update(rtol=rtol, table_rtol=table_rtol)
        out["variants"][x.info.name] = entry
    return out


def _size(e: float | None) -> float:
    """An error as a sort key: unknown or NaN first (the worst), then by size."""
    return math.inf if e is None or e != e else e


def _inconsistent(
    m: Any, ref: Any, names: Sequence[str], numels: Sequence[int], dtype: str, rtol: float, table_rtol: float
) -> list[dict[str, Any]]:
    """The cells of one run that fail the consistency check, with their verdict and relative error."""
    if not m.statuses or not ref.statuses or m.norms is None or ref.norms is None or m.rel_errors is None:
        return []
    rel = m.rel_errors
    table = judge(ref.statuses, ref.norms, m.statuses, m.norms, rel, numels, dtype, table_rtol)
    noise = noise_pairs(ref.statuses, ref.norms, m.statuses, m.norms, numels, dtype)
    floor = noise_floor(ref.norms, numels, dtype)
    out = []
    for i, name in enumerate(names):
        e, st, rst = rel[i], m.statuses[i], ref.statuses[i]
        if e is None:  # neither has a gradient
            continue
        why = table[i]
        if why == "match":
            if st in ("nan", "inf") or rst in ("nan", "inf"):
                why = "nonfinite"
            elif st == rst == "nonzero" and not all(noise[i]) and not e <= rtol:
                # Beyond the consistency rtol, and by more than the noise floor per element.
                diff = e * (ref.norms[i] or 0.0) / max(numels[i], 1)
                why = "off" if not diff <= floor else "match"
        if why != "match":
            out.append({"scenario": m.scenario, "parameter": name, "verdict": why, "rel_error": e,
                        "status": st, "reference_status": rst})  # fmt: skip
    return out


def _terms_off(m: Any, ref: Any, rtol: float, floor_of: float) -> list[dict[str, Any]]:
    """The term values of one run that differ from the reference's beyond ``rtol`` of the reference
    value plus the noise floor of the run's largest term (NaN on either side differs)."""
    known = [abs(r) for r in ref.term_values.values() if r is not None and math.isfinite(r)]
    allowance = floor_of * max(known, default=0.0)
    out = []
    for t, v in m.term_values.items():
        r = ref.term_values.get(t)
        if v is None or r is None or abs(v - r) <= rtol * abs(r) + allowance:
            continue
        gap = abs(v - r)
        out.append({"scenario": m.scenario, "term": t, "value": v, "reference": r,
                    "rel_error": gap / abs(r) if r else math.inf})  # fmt: skip
    return out


def _float64_copy(model: torch.nn.Module, batch: Mapping[str, Any]) -> tuple[torch.nn.Module, dict[str, Any]]:
    """A float64 deep copy of the model and batch: finite differences need the precision, and the
    user's model is never touched."""
    model64 = model_copy(model).double()
    batch64 = {
        k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in batch.items()
    }
    return model64, batch64


def physics_check(
    spec: ProbeSpec, model: torch.nn.Module, batch: Any, *, samples: int = 8, h: float = 1e-5, seed: int = 0
) -> dict[str, Any]:
    """Forces vs -dE/dx (central differences on a sample of atoms and directions), the force sum rule,
    and the virial vs the strain derivative of the energy, all in float64 on a copy of the model."""
    if spec.energy_fn is None or spec.predict is None:
        raise SpecError("the physics check needs spec.energy_fn and spec.predict (the model's forces)")
    if not isinstance(batch, Mapping) or spec.coord_key not in batch:
        raise SpecError(f"the physics check needs a dict batch with coordinates under {spec.coord_key!r}")
    model64, b = _float64_copy(model, batch)
    energy_fn, predict = spec.energy_fn, spec.predict
    result = physics_of(
        lambda x: energy_fn(model64, x), lambda x: predict(model64, x), b, spec, samples, h, seed
    )
    if result["failures"]:
        result["cuts"] = _coordinate_cuts(spec, model64, b)
    return result


def path_physics(
    spec: ProbeSpec, predict: Any, energy: Any, batch: Any, reference: Mapping[str, torch.Tensor] | None,
    samples: int = 8, h: float = 1e-5, seed: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """The physics check of one execution path: ``predict(batch)`` gives that path's own forces (and
    virial), ``energy(batch)`` its energies per frame; they are checked against finite differences of
    that energy, and against the reference path's outputs (``reference``, allclose at 1e-10 of their
    scale in float64). Runs at the batch's dtype: meaningful in float64 (the path is not copied)."""
    result = physics_of(energy, predict, batch, spec, samples, h, seed)
    if reference is not None:
        with torch.enable_grad():
            mine = predict(batch)
        outputs = {}
        for key in ("energy", "force", "virial"):
            a, r = mine.get(key), reference.get(key)
            if a is None or r is None:
                continue
            a, r = a.detach().reshape(-1).double(), r.detach().reshape(-1).double()
            scale = float(r.abs().max()) or 1.0
            outputs[key] = float((a - r).abs().max()) / scale if a.shape == r.shape else math.inf
        result["outputs"] = outputs
        for key, err in outputs.items():
            if not err <= OUTPUT_RTOL:
                result["failures"].append(
                    f"{key} differs from the reference path's by {err:.2g} of its scale"
                )
        result["passed"] = not result["failures"]
    return result


# Outputs of two correct paths agree to this, relative to their scale, in float64.
OUTPUT_RTOL = 1e-10


def physics_of(
    energy_of: Any, predict: Any, b: Mapping[str, Any], spec: ProbeSpec, samples: int, h: float, seed: int
) -> dict[str, Any]:
    """The finite-difference physics checks on one path's ``energy_of(batch)`` and ``predict(batch)``."""
    coord = b[spec.coord_key]
    with torch.enable_grad():
        pred = predict(b)
    force = pred["force"].detach()
    nf = force.shape[0]
    force = force.reshape(nf, -1, 3)
    natoms = force.shape[1]

    def energy(**changes: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():  # a path may take its forces by autograd.grad inside
            return energy_of({**b, **changes}).detach().reshape(-1)

    g = torch.Generator().manual_seed(seed)
    picks = [(int(torch.randint(nf, (1,), generator=g)), int(torch.randint(natoms, (1,), generator=g)),
              int(torch.randint(3, (1,), generator=g))) for _ in range(samples)]  # fmt: skip
    worst = {"abs_error": 0.0}
    errors = []
    for f, i, d in picks:
        step = torch.zeros_like(coord)
        step[f, i, d] = h
        fd = -(energy(**{spec.coord_key: coord + step})[f] - energy(**{spec.coord_key: coord - step})[f]) / (
            2 * h
        )
        err = abs(float(force[f, i, d] - fd))
        errors.append(err)
        if not err < worst["abs_error"]:  # NaN is the worst of all
            worst = {"frame": f, "atom": i, "direction": "xyz"[d], "force": float(force[f, i, d]),
                     "finite_difference": float(fd), "abs_error": err}  # fmt: skip
    scale = float(force.abs().max()) or 1.0
    worst_error = math.nan if any(e != e for e in errors) else max(errors)
    result: dict[str, Any] = {
        "samples": samples,
        "force": {
            "max_abs_error": worst_error,
            "max_rel_error": worst_error / scale,
            "scale": scale,
            "worst": worst,
        },
    }
    residual = force.sum(dim=1).abs().max().item()
    result["sum_rule"] = {
        "max_residual": residual,
        "relative": residual / (force.abs().mean().item() * natoms or 1.0),
    }
    failures = []
    # `not x <= tol`, never `x > tol`: a NaN error is a failure.
    if not result["force"]["max_rel_error"] <= FORCE_RTOL:
        failures.append(
            f"forces differ from -dE/dx by up to {result['force']['max_rel_error']:.2g} of the force scale "
            f"(frame {worst['frame']}, atom {worst['atom']}, {worst['direction']}: {worst['force']:.6g} vs "
            f"{worst['finite_difference']:.6g})"
        )
    if not result["sum_rule"]["relative"] <= SUM_RULE_RTOL:
        failures.append(
            f"forces do not sum to zero: residual {residual:.3g} ({result['sum_rule']['relative']:.2g} relative)"
        )
    if spec.box_key is not None and spec.box_key in b and "virial" in pred:
        virial = pred["virial"].detach().reshape(nf, 3, 3)
        result["virial"] = _virial(virial, energy, coord, b[spec.box_key], spec, h)
        if not result["virial"]["max_rel_error"] <= VIRIAL_RTOL:
            failures.append(
                f"virial differs from the strain derivative by {result['virial']['max_rel_error']:.2g}"
            )
    result["failures"] = failures
    result["passed"] = not failures
    return result


def _coordinate_cuts(spec: ProbeSpec, model64: torch.nn.Module, b: dict[str, Any]) -> list[dict[str, Any]]:
    """Where the energy path's dependence on the coordinates stops carrying gradient: one recorded
    step of ``energy_fn`` and of ``predict`` with the coordinates (and cell) as lineage sources. A
    force from a gradient that misses part of the energy's dependence is not -dE/dx."""
    from .evidence.lineage import record

    sources = [
        (k, b[k])
        for k in (spec.coord_key, spec.box_key)
        if k is not None and isinstance(b.get(k), torch.Tensor)
    ]
    found: dict[tuple[str, int, str], dict[str, Any]] = {}
    calls = (("energy", lambda: {"energy": spec.energy_fn(model64, b)}),  # type: ignore[misc]
             ("force", lambda: {"force": spec.predict(model64, b)["force"]}))  # type: ignore[misc]  # fmt: skip
    for what, call in calls:
        with torch.enable_grad():
            lin = record(model64, sources, call, f"{what} path", lambda r: r)
        term = lin.terms.get(what)
        if term is None:
            continue
        for site in lin.sites:
            if site.id in term.sites and site.parameters:
                d = site.to_dict()
                d["path"] = what
                found.setdefault((d["file"], d["line"], d["kind"]), d)
    return list(found.values())


def _virial(virial: torch.Tensor, energy: Any, coord: torch.Tensor, box: torch.Tensor, spec: ProbeSpec,
            h: float) -> dict[str, Any]:  # fmt: skip
    """-dE/d(strain) by central differences; coordinates and cell deformed together: x' = x (I + e)^T."""
    fd = torch.zeros_like(virial)
    for a in range(3):
        for c in range(3):
            eps = torch.zeros(3, 3, dtype=coord.dtype, device=coord.device)
            eps[a, c] = h
            eye = torch.eye(3, dtype=coord.dtype, device=coord.device)
            plus, minus = eye + eps, eye - eps
            e_plus = energy(**{spec.coord_key: coord @ plus.T, spec.box_key: box @ plus.T})  # type: ignore[dict-item]
            e_minus = energy(**{spec.coord_key: coord @ minus.T, spec.box_key: box @ minus.T})  # type: ignore[dict-item]
            fd[:, c, a] = -(e_plus - e_minus) / (2 * h)  # virial_ca = sum_i x_c F_a = -dE/de_ac
    scale = float(fd.abs().max()) or 1.0
    return {
        "max_abs_error": float((virial - fd).abs().max()),
        "max_rel_error": float((virial - fd).abs().max()) / scale,
        "asymmetry": float((virial - virial.transpose(-1, -2)).abs().max()) / scale,
    }


def training_check(
    spec: ProbeSpec,
    model: torch.nn.Module,
    variants: Sequence[VariantSpec],
    mode: str,
    terms: Sequence[str],
    scenarios: Sequence[Scenario],
    batch: Any,
    ref_name: str,
    steps: int = 5,
) -> dict[str, Any]:
    """``steps`` optimizer steps per variant and per single-term scenario on a deep copy of the model,
    from the same start each time; records each term's curve and whether it decreases."""
    alone = [s for s in scenarios if len(s.terms) == 1]
    # Memory beyond a plain step: the copy and the optimizer's state. Each run starts again from the
    # user's parameters (read, never written), and gradients are dropped after each optimizer step.
    copy_model = model_copy(model)
    params = [p for p in copy_model.parameters() if p.requires_grad]
    start = [p for p in model.parameters() if p.requires_grad]
    curves: dict[str, dict[str, list[float]]] = {}
    verdicts: dict[str, dict[str, str]] = {}
    errors: dict[str, dict[str, str]] = {}
    errors_where: dict[str, dict[str, Any]] = {}  # the user's frame of each failure, where known
    compiled_steps: dict[str, dict[str, int]] = {}  # steps in which the path's compiled code ran
    moved: dict[str, dict[str, float]] = {}  # |p - p0|_1 / |p0|_1 of the copy after the steps
    for variant in variants:
        ctx = VariantContext(
            copy_model, spec.step, mode, terms, batch, make_weights(terms, terms, params[0]), seed=spec.seed
        )
        with stage(f"{variant.name}: build"):
            built = build(variant, ctx)
        curves[variant.name], verdicts[variant.name], errors[variant.name] = {}, {}, {}
        compiled_steps[variant.name], moved[variant.name] = {}, {}
        for s in alone:
            (term,) = s.terms
            with torch.no_grad():
                for p, p0 in zip(params, start, strict=True):
                    p.copy_(p0)
            optimizer = fresh_optimizer(spec, params, copy_model)
            curve: list[float] = []
            try:
                if built.error is not None:
                    raise RuntimeError(f"{built.error.stage}: {built.error.message}")
                assert built.run is not None
                counter = built.counter
                with stage(f"{variant.name}: {term} alone, {steps} steps"):
                    for k in range(steps + 1):
                        reseed(spec.seed)
                        executions = counter.executions if counter is not None else 0
                        total, values = check_total(
                            built.run(batch, make_weights(terms, s.terms, params[0])), terms
                        )
                        if counter is not None:
                            if counter.executions == executions:
                                # A step that ran eager would train (and judge) eager, not this path.
                                raise RuntimeError(
                                    f"step {k}: "
                                    + (getattr(counter, "fallback_message", None) or "no compiled code ran")
                                )
                            compiled_steps[variant.name][term] = k + 1
                        curve.append(float(values.get(term, total).detach()))
                        if len(curve) > steps:
                            break
                        target = isolated(total, values, s.terms) if mode == "terms" else total
                        if not target.requires_grad:
                            raise RuntimeError(f"the {term} loss has no gradient path")
                        grads = torch.autograd.grad(target, params, allow_unused=True)
                        for p, g in zip(params, grads, strict=True):
                            p.grad = g
                        del grads, total, values
                        optimizer.step()
                        for p in params:
                            p.grad = None
            except Exception as e:
                for p in params:
                    p.grad = None
                err = run_error("training", e)
                errors[variant.name][term] = f"{err.type}: {err.message}"
                if err.where:
                    errors_where.setdefault(variant.name, {})[term] = err.where
                verdicts[variant.name][term] = "error"
                curves[variant.name][term] = curve
                continue
            curves[variant.name][term] = curve
            verdicts[variant.name][term] = _trend(curve)
            moved[variant.name][term] = _moved(params, start)
    reference = curves.get(ref_name, {})
    divergence = {
        v: max((_curve_gap(c, reference.get(t)) for t, c in cs.items()), default=0.0)
        for v, cs in curves.items()
        if v != ref_name
    }
    return {
        "steps": steps,
        "optimizer": type(fresh_optimizer(spec, params, copy_model)).__name__,
        "curves": curves,
        "verdicts": verdicts,
        "errors": errors,
        **({"errors_where": errors_where} if errors_where else {}),
        "divergence_from_reference": divergence,
        "compiled_steps": {v: c for v, c in compiled_steps.items() if c},
        "moved": moved,
        "passed": all(v == "decreases" for vs in verdicts.values() for v in vs.values()),
    }


def _moved(params: Sequence[torch.Tensor], start: Sequence[torch.Tensor]) -> float:
    """How far the steps moved the copy's parameters: |p - p0|_1 / |p0|_1 over all of them."""
    with torch.no_grad():
        diff = sum(float((p - p0).abs().sum()) for p, p0 in zip(params, start, strict=True))
        base = sum(float(p0.abs().sum()) for p0 in start)
    return diff / base if base else diff


def _trend(curve: list[float]) -> str:
    if len(curve) < 2 or not all(math.isfinite(c) for c in curve):
        return "error" if not all(math.isfinite(c) for c in curve) else "flat"
    first, last = curve[0], curve[-1]
    if last < first * (1 - 1e-6) - 1e-300:
        return "decreases"
    if abs(last - first) <= 1e-6 * abs(first):
        return "flat"
    return "increases"


def _curve_gap(curve: list[float], reference: list[float] | None) -> float:
    if not reference or not curve:
        return math.inf if reference else 0.0
    n = min(len(curve), len(reference))
    return max(abs(a - b) / max(abs(b), 1e-300) for a, b in zip(curve[:n], reference[:n], strict=True))
