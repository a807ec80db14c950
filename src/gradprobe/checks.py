"""Verification: the checks that say a fix is done.

* ``consistency_report``: every variant's gradients and term values against the reference, judged as
  the flow map's cells are (relative L1 error per parameter, the run's noise floor) at a tighter rtol
  (float64 reaches 1e-10), worst offenders by name — from the probe's own measurements.
* ``physics_check``: for potentials, forces against minus central finite differences of the energy,
  the force sum rule, and the virial against the strain derivative (and its symmetry). Catches ghost
  forces sliced instead of scatter-summed, which leave gradient counts unchanged. In float64 where a
  float64 copy runs; else in the model's own dtype, judged against the measured noise of the
  differences, with the error it can detect stated. Any batch whose atoms ``geometry.py`` can find.
* ``training_check``: a few optimizer steps per variant and term on a deep copy (on the model itself,
  its state put back, when none can be made); does each term's loss go down, and do compiled
  trajectories follow eager's?

Shape sweeps (other batch shapes) are measured in ``probe.py`` next to the second-batch check.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .batch import as_float64
from .build import VariantContext, build
from .compare import NOISE_FLOOR, consistency_tolerance, judge, noise_floor, noise_pairs, tolerance
from .copies import model_copy, working_model
from .errors import SpecError
from .geometry import Atoms, Geometry, dict_geometry
from .measure import gradients_of, isolated, run_error
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
        autocast = x.computes_in  # the knob, or the precision observed of the path or the reference
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


def _geometry(spec: ProbeSpec) -> Geometry:
    """Where the spec's batches keep their atoms: ``spec.geometry``, or stacked frames in a dict
    under ``coord_key`` and ``box_key``."""
    return spec.geometry if spec.geometry is not None else dict_geometry(spec.coord_key, spec.box_key)


def _own_dtype(model: torch.nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())


def physics_check(
    spec: ProbeSpec, model: torch.nn.Module, batch: Any, *, samples: int = 8, h: float = 1e-5, seed: int = 0
) -> dict[str, Any]:
    """Forces vs -dE/dx (central differences on a sample of atoms and directions), the force sum rule,
    and the virial vs the strain derivative of the energy: in float64 on a copy of the model where
    one can be made and runs; else in the model's own dtype (tolerances from that dtype and the
    measured noise of the finite differences, the error it can detect stated), on the copy or, when
    none can be made, on the model itself, whose state is put back after. ``result["precision"]``
    says which, and why."""
    if spec.energy_fn is None or spec.predict is None:
        raise SpecError("the physics check needs spec.energy_fn and spec.predict (the model's forces)")
    geometry = _geometry(spec)
    if spec.geometry is None and (not isinstance(batch, Mapping) or spec.coord_key not in batch):
        raise SpecError(f"the physics check needs a dict batch with coordinates under {spec.coord_key!r}")
    geometry.read(batch)  # positions that cannot be found are bad input, raised before anything runs
    energy_fn, predict = spec.energy_fn, spec.predict

    def on(m: torch.nn.Module, b: Any, judged: str) -> dict[str, Any]:
        result = physics_of(
            lambda x: energy_fn(m, x), lambda x: predict(m, x), b, geometry, samples,
            h if judged == "float64" else REDUCED_STEP, seed, judged,
        )  # fmt: skip
        if result["failures"]:
            result["cuts"] = _coordinate_cuts(spec, m, b, geometry)
        return result

    own = _own_dtype(model)
    with working_model(model) as (work, why):
        on_what = "the model itself"
        if why is None or own == torch.float64:
            m, b = (work.double(), as_float64(batch)) if why is None else (model, batch)
            on_what = "a float64 copy" if why is None else on_what
            try:
                result = on(m, b, "float64")
            except Exception as e:
                if own == torch.float64:
                    raise
                why = f"a float64 copy could not run ({described(e)})"
            else:
                noisy = result.pop("noisy")
                if noisy is None:
                    result["precision"] = {"dtype": "float64", "on": on_what, **({"why": why} if why else {})}
                    return result
                why = f"{why}; {noisy}" if why else noisy
            if work is not model:  # the copy is float64 now: a fresh one in the model's own dtype
                work, on_what = model_copy(model), "a copy"
        result = on(work, batch, "noise")
    result.pop("noisy")
    result["precision"] = {**result["precision"], "dtype": str(own).removeprefix("torch."), "on": on_what,
                           "why": why}  # fmt: skip
    return result


def described(e: BaseException, limit: int = 160) -> str:
    """``RuntimeError: both inputs should have same dtype, at sevenn/nn/linear.py:95``: the error's
    first line and the user's frame it came from (a check that could not run says where)."""
    from .frames import user_frame_of

    text = str(e).strip().splitlines()
    where = user_frame_of(e)
    at = f", at {_short(where['file'])}:{where['line']}" if where else ""
    return f"{type(e).__name__}: {text[0][:limit] if text else ''}{at}"


def _short(file: str) -> str:
    """A file path from its package on (``sevenn/nn/linear.py``), or as it is."""
    marker = "site-packages/"
    return file[file.index(marker) + len(marker) :] if marker in file else file


def path_physics(
    spec: ProbeSpec, predict: Any, energy: Any, batch: Any, reference: Mapping[str, torch.Tensor] | None,
    samples: int = 8, h: float = 1e-5, seed: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """The physics check of one execution path: ``predict(batch)`` gives that path's own forces (and
    virial), ``energy(batch)`` its energies per frame; they are checked against finite differences of
    that energy, and against the reference path's outputs (``reference``, allclose at 1e-10 of their
    scale in float64). Runs at the batch's dtype: meaningful in float64 (the path is not copied)."""
    result = physics_of(energy, predict, batch, _geometry(spec), samples, h, seed, torch.float64)
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
# Below float64: the finite-difference step, in the units of the positions (and of the strain), and
# the rigid translations whose energy changes measure the noise of the energy (a potential does not
# change when every atom moves by the same vector: what changes is rounding).
REDUCED_STEP = 1e-2
TRANSLATIONS = 3
# A finite difference is judged against this many times the noise it can carry.
NOISE_FACTOR = 3.0


def physics_of(
    energy_of: Any, predict: Any, b: Any, geometry: Geometry, samples: int, h: float, seed: int,
    judged: str = "float64",
) -> dict[str, Any]:  # fmt: skip
    """The finite-difference physics checks on one path's ``energy_of(batch)`` and ``predict(batch)``.

    ``judged="float64"``: each difference against fixed tolerances (``FORCE_RTOL``...), and
    ``result["noisy"]`` says when the energy is too noisy for them (a cast to float32 inside a model
    run in float64). ``judged="noise"`` (a model run in its own lower precision): against the noise
    the difference can carry: the energy's own noise, measured by rigid
    translations, over the step, plus the change between steps ``h`` and ``2h`` (truncation), plus
    the dtype's rounding of the forces; and the forces of each frame are also checked along their own
    direction (all atoms moved together), where the signal is the whole frame's force: ``detectable``
    is the relative error of the forces that this check catches."""
    atoms = geometry.read(b)
    pos = atoms.positions
    with torch.enable_grad():
        pred = predict(b)
    force = pred["force"].detach().reshape(-1, 3)
    if force.shape[0] != pos.shape[0]:
        raise ValueError(f"predict gave forces for {force.shape[0]} atoms; the batch has {pos.shape[0]}")
    reduced = judged == "noise"
    dtype = str(force.dtype).removeprefix("torch.")
    eps = torch.finfo(force.dtype).eps

    def energy(x: torch.Tensor | None = None, cells: torch.Tensor | None = None) -> torch.Tensor:
        moved = geometry.moved(b, atoms, pos if x is None else x, cells)
        with torch.enable_grad():  # a path may take its forces by autograd.grad inside
            return energy_of(moved).detach().reshape(-1).double()

    nf = atoms.frames
    counts = atoms.counts()
    members = [torch.nonzero(atoms.frame == f).reshape(-1) for f in range(nf)]
    g = torch.Generator().manual_seed(seed)
    picks = []
    for _ in range(samples):
        f = int(torch.randint(nf, (1,), generator=g))
        i = int(torch.randint(int(counts[f]), (1,), generator=g))
        picks.append((f, i, int(torch.randint(3, (1,), generator=g))))
    noise = _energy_noise(energy, pos, atoms, h, seed, eps)
    force64 = force.double()

    def derivative(direction: torch.Tensor, f: int, step: float) -> float:
        d = step * direction.to(pos.dtype)
        return -float(energy(pos + d)[f] - energy(pos - d)[f]) / (2 * step)

    worst = {"abs_error": 0.0}
    errors, tolerances, finite_differences = [], [], []
    for f, i, d in picks:
        atom = int(members[f][i])
        e = _unit(pos, atom, d)
        fd = derivative(e, f, h)
        finite_differences.append(fd)
        err = abs(float(force64[atom, d]) - fd)
        errors.append(err)
        if reduced:
            tolerances.append(
                _tolerance(noise[f], h, fd, derivative(e, f, 2 * h), eps * abs(float(force64[atom, d])))
            )
        if not err < worst["abs_error"]:  # NaN is the worst of all
            worst = {"frame": f, "atom": i, "direction": "xyz"[d], "force": float(force64[atom, d]),
                     "finite_difference": fd, "abs_error": err}  # fmt: skip
    scale = float(force64.abs().max()) or 1.0
    worst_error = math.nan if any(e != e for e in errors) else max(errors)
    result: dict[str, Any] = {
        "samples": samples,
        "force": {
            "max_abs_error": worst_error,
            "max_rel_error": worst_error / scale,
            "scale": scale,
            "worst": worst,
        },
        "noisy": None,
    }
    sums = torch.zeros(nf, 3, dtype=torch.float64).index_add_(0, atoms.frame, force64)
    residual = float(sums.abs().max())
    natoms = int(counts.max())
    result["sum_rule"] = {
        "max_residual": residual,
        "relative": residual / (float(force64.abs().mean()) * natoms or 1.0),
    }
    failures = []
    sum_rtol = max(SUM_RULE_RTOL, 1e4 * eps) if reduced else SUM_RULE_RTOL
    if reduced:
        along = _along_forces(force64, members, derivative, noise, h, eps)
        result["force"]["along"] = along
        result["force"]["tolerance"] = max(t / scale for t in tolerances) if tolerances else None
        result["detectable"] = max((a["tolerance"] for a in along), default=math.nan)
        bad = [k for k, (err, tol) in enumerate(zip(errors, tolerances, strict=True)) if not err <= tol]
        if bad:
            f, i, d = picks[bad[0]]
            atom = int(members[f][i])
            failures.append(
                f"forces differ from -dE/dx by up to {worst_error / scale:.2g} of the force scale, beyond the "
                f"{max(tolerances) / scale:.2g} that {dtype} finite differences "
                f"can carry here (frame {f}, atom {i}, {'xyz'[d]}: {float(force64[atom, d]):.6g} vs "
                f"{derivative(_unit(pos, atom, d), f, h):.6g})"
            )
        off = [a for a in along if not a["rel_error"] <= a["tolerance"]]
        if off:
            a = max(off, key=lambda a: a["rel_error"] if a["rel_error"] == a["rel_error"] else math.inf)
            failures.append(
                f"along the forces of frame {a['frame']}, -dE/dx is {a['finite_difference']:.6g} and the forces "
                f"give {a['force']:.6g}: they differ by {a['rel_error']:.2g} of the frame's force, beyond the "
                f"{a['tolerance']:.2g} that {dtype} finite differences can carry"
            )
    elif max(noise) / h / scale > FORCE_RTOL:
        # Energies as noisy as a lower precision's (a cast inside the model): differences at this step
        # cannot be judged at float64's tolerances; the caller checks in the model's own precision.
        result["noisy"] = (
            f"the float64 copy's energy is noisy ({max(noise) / h / scale:.2g} of the force scale at step {h:g}: "
            "a cast to a lower precision inside the model?)"
        )
    elif not result["force"]["max_rel_error"] <= FORCE_RTOL:  # `not x <= tol`: a NaN error is a failure
        failures.append(
            f"forces differ from -dE/dx by up to {result['force']['max_rel_error']:.2g} of the force scale "
            f"(frame {worst['frame']}, atom {worst['atom']}, {worst['direction']}: {worst['force']:.6g} vs "
            f"{worst['finite_difference']:.6g})"
        )
    if reduced:
        result["sum_rule"]["tolerance"] = sum_rtol
    if failures and all(fd == 0 for fd in finite_differences) and scale > 0:
        failures[0] += (
            f"; the energy does not change when the positions move (at {geometry.positions!r}): the model reads "
            "something computed from them before it was called (edge vectors, distances), which the check "
            "must recompute for each move: give a rebuild (gradprobe.geometry.edge_vectors, the potential "
            "adapter's rebuild=...)"
        )
    if not result["sum_rule"]["relative"] <= sum_rtol:
        failures.append(
            f"forces do not sum to zero: residual {residual:.3g} ({result['sum_rule']['relative']:.2g} relative)"
        )
    if atoms.cells is not None and "virial" in pred:
        virial = pred["virial"].detach().reshape(nf, 3, 3).double()
        result["virial"] = _virial(virial, energy, atoms, h, noise if reduced else None, eps)
        tol = result["virial"].get("tolerance", VIRIAL_RTOL)
        if not result["virial"]["max_rel_error"] <= tol:
            failures.append(
                f"virial differs from the strain derivative by {result['virial']['max_rel_error']:.2g}"
                + (f", beyond the {tol:.2g} that {dtype} finite differences can carry" if reduced else "")
                + ("; it matches with the opposite sign: a stress in another sign convention?"
                   if result["virial"]["opposite_sign_error"] <= tol else "")
            )  # fmt: skip
    if reduced:
        result["precision"] = {"step": h, "detectable": result["detectable"], "sum_rule_tolerance": sum_rtol}
    result["failures"] = failures
    result["passed"] = not failures
    return result


def _unit(pos: torch.Tensor, atom: int, d: int) -> torch.Tensor:
    e = torch.zeros_like(pos)
    e[atom, d] = 1.0
    return e


def _energy_noise(
    energy: Any, pos: torch.Tensor, atoms: Atoms, h: float, seed: int, eps: float
) -> list[float]:
    """Per frame, the largest change of the energy under rigid translations of length ``h`` (every atom
    moved by the same vector, the cell kept): a potential does not change there, so what changes is
    the noise of its evaluation; at least the rounding of the energy itself (``eps`` of its size)."""
    base = energy()
    g = torch.Generator().manual_seed(seed + 1)
    noise = eps * base.abs()
    for _ in range(TRANSLATIONS):
        t = torch.randn(3, generator=g, dtype=torch.float64)
        t = (h * t / t.norm()).to(pos.dtype)
        for sign in (1, -1):
            noise = torch.maximum(noise, (energy(pos + sign * t) - base).abs())
    return noise.tolist()


def _tolerance(noise: float, h: float, fd: float, fd2: float, rounding: float) -> float:
    """What a central difference at step ``h`` can carry: the energy's noise over the step, the change
    from the difference at ``2h`` (truncation, three times the error at ``h``), and the rounding of
    the force itself."""
    return NOISE_FACTOR * noise / h + abs(fd2 - fd) + NOISE_FACTOR * rounding


def _along_forces(force: torch.Tensor, members: list[torch.Tensor], derivative: Any, noise: list[float],
                  h: float, eps: float) -> list[dict[str, Any]]:  # fmt: skip
    """Per frame, -dE/dx along the frame's own forces (unit direction u = F/|F| over its atoms) vs
    F·u = |F|: relative to |F|, the error of forces scaled by (1 + x) is x."""
    out = []
    for f, idx in enumerate(members):
        norm = float(force[idx].norm())
        if not norm > 0:
            continue
        u = torch.zeros_like(force)
        u[idx] = force[idx] / norm
        u = u.to(torch.float64)
        fd = derivative(u, f, h)
        tol = _tolerance(noise[f], h, fd, derivative(u, f, 2 * h), eps * norm) / norm
        out.append({"frame": f, "force": norm, "finite_difference": fd, "rel_error": abs(norm - fd) / norm,
                    "tolerance": tol})  # fmt: skip
    return out


def _coordinate_cuts(
    spec: ProbeSpec, model: torch.nn.Module, b: Any, geometry: Geometry
) -> list[dict[str, Any]]:
    """Where the energy path's dependence on the coordinates stops carrying gradient: one recorded
    step of ``energy_fn`` and of ``predict`` with the coordinates (and cell) as lineage sources. A
    force from a gradient that misses part of the energy's dependence is not -dE/dx."""
    from .evidence.lineage import record

    atoms = geometry.read(b)
    pos = atoms.positions.clone()
    cells = None if atoms.cells is None else atoms.cells.clone()
    sources = [("positions", pos)] + ([] if cells is None else [("cell", cells)])

    def moved() -> Any:
        return geometry.moved(b, atoms, pos, cells)

    found: dict[tuple[str, int, str], dict[str, Any]] = {}
    calls = (("energy", lambda: {"energy": spec.energy_fn(model, moved())}),  # type: ignore[misc]
             ("force", lambda: {"force": spec.predict(model, moved())["force"]}))  # type: ignore[misc]  # fmt: skip
    for what, call in calls:
        with torch.enable_grad():
            lin = record(model, sources, call, f"{what} path", lambda r: r)
        term = lin.terms.get(what)
        if term is None:
            continue
        for site in lin.sites:
            if site.id in term.sites and site.parameters:
                d = site.to_dict()
                d["path"] = what
                found.setdefault((d["file"], d["line"], d["kind"]), d)
    return list(found.values())


def _virial(virial: torch.Tensor, energy: Any, atoms: Atoms, h: float, noise: list[float] | None,
            eps: float) -> dict[str, Any]:  # fmt: skip
    """-dE/d(strain) by central differences; coordinates and cells deformed together: x' = x (I + e)^T.
    ``noise`` (below float64): judged against what the differences can carry, as the forces are."""
    assert atoms.cells is not None
    pos, cells = atoms.positions, atoms.cells

    def strained(a: int, c: int, step: float) -> torch.Tensor:
        eps_ = torch.zeros(3, 3, dtype=pos.dtype, device=pos.device)
        eps_[a, c] = step
        eye = torch.eye(3, dtype=pos.dtype, device=pos.device)
        plus, minus = eye + eps_, eye - eps_
        e_plus = energy(pos @ plus.T, cells @ plus.T)
        e_minus = energy(pos @ minus.T, cells @ minus.T)
        return -(e_plus - e_minus) / (2 * step)  # virial_ca = sum_i x_c F_a = -dE/de_ac

    fd = torch.zeros_like(virial)
    tol = torch.zeros_like(virial)
    for a in range(3):
        for c in range(3):
            fd[:, c, a] = strained(a, c, h)
            if noise is not None:
                change = (strained(a, c, 2 * h) - fd[:, c, a]).abs()
                tol[:, c, a] = NOISE_FACTOR * torch.tensor(noise, dtype=fd.dtype) / h + change
    scale = float(fd.abs().max()) or 1.0
    out = {
        "max_abs_error": float((virial - fd).abs().max()),
        "max_rel_error": float((virial - fd).abs().max()) / scale,
        "asymmetry": float((virial - virial.transpose(-1, -2)).abs().max()) / scale,
        "opposite_sign_error": float((virial + fd).abs().max()) / scale,
    }
    if noise is not None:
        out["tolerance"] = float(tol.max()) / scale + NOISE_FACTOR * eps
    return out


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
    """``steps`` optimizer steps per variant and per single-term scenario on a deep copy of the model
    (on the model itself, its state put back after, when it cannot be copied: ``result["on"]`` and
    ``result["why"]``), from the same start each time; records each term's curve and whether it
    decreases."""
    with working_model(model) as (work, why):
        start = [p for p in model.parameters() if p.requires_grad]
        if work is model:  # the steps move these very tensors: start from a copy of their values
            start = [p.detach().clone() for p in start]
        result = _training(spec, work, start, variants, mode, terms, scenarios, batch, ref_name, steps)
    result["on"] = "a copy" if why is None else "the model itself"
    if why is not None:
        result["why"] = why
    return result


def _training(
    spec: ProbeSpec, copy_model: torch.nn.Module, start: list[torch.Tensor], variants: Sequence[VariantSpec],
    mode: str, terms: Sequence[str], scenarios: Sequence[Scenario], batch: Any, ref_name: str, steps: int,
) -> dict[str, Any]:  # fmt: skip
    alone = [s for s in scenarios if len(s.terms) == 1]
    # Memory beyond a plain step: the copy and the optimizer's state. Each run starts again from the
    # user's parameters (read, never written), and gradients are dropped after each optimizer step.
    params = [p for p in copy_model.parameters() if p.requires_grad]
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
                        grads = gradients_of(target, params)
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
