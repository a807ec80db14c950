"""gradprobe's cost against the naive loop and against the floor, in one run.

    python benchmarks/bench_probe.py            # full run (a few minutes on 2 cores)
    python benchmarks/bench_probe.py --quick    # smoke run with tiny sizes (numbers meaningless)

Sections:
  1. probe vs naive loop (eager): gradprobe.probe against k scenarios x (zero_grad, forward,
     float-weighted total, backward(), bool(p.grad.abs().sum() > 0) per parameter).
  2. probe vs floor: eager, against one forward + k autograd.grad; compiled
     (make_fx[detach=alias]+compile:aot_eager), against one trace-and-compile + k+1 forward/backward.
  3. compiles per compiled variant: gradprobe's variant against the naive loop with Python-float weights.
  4. host syncs per scenario, at 1x, 4x, 16x the parameter tensors.
  5. memory (peak RSS over a plain training step, fresh process each) and flow-map size.
  6. models written unlike the wide model (benchmarks/other_models.py): three small models (a
     functional one, an nn.Sequential MLP with BatchNorm and Dropout, a transformer layer; 10-15
     tensors) and many tiny blocks in sequence at 512 / 2,048 / 8,192 tensors: probe, naive
     loop and floor, and the scaling exponent of the probe against the floor's.
  7. diagnose time on the reference potential: probe vs probe + diagnose, every variant matching
     and one failing (bisected); the lineage recording on its own line.
  8. the same on a real package (SchNetPack 2.1, benchmarks/real_package.py; skipped when it is not
     installed), with where each bisection trial's time goes.
Then one PASS/FAIL line per requirement. Timings: one thread, interleaved rounds (A B C A B C ...),
the minimum of each; ratios of minima. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from baselines import (  # noqa: E402
    default_scenarios,
    float_weights,
    floor_compiled,
    floor_eager,
    naive_compiled,
    naive_eager,
)
from other_models import (  # noqa: E402
    BLOCK_TERMS,
    ENCODER_TERMS,
    MLP_TERMS,
    SMALL_TERMS,
    blocks_step,
    encoder_step,
    make_blocks,
    make_encoder,
    make_mlp,
    make_small,
    mlp_step,
    small_step,
)
from syncs import SyncCounter  # noqa: E402
from timing import best, interleaved  # noqa: E402
from wide_model import TERMS, make_wide, size_of, wide_step  # noqa: E402

import gradprobe  # noqa: E402
from gradprobe.zoo import reference_spec  # noqa: E402

COMPILED = "make_fx[detach=alias]+compile:aot_eager"

FULL = {
    "eager_reps_reference": 15,
    "eager_reps_wide": 7,
    "wide": {"n_branches": 2048, "width": 16, "n_big": 3, "big_dim": 4096, "batch_size": 8},
    "compiled_model": "reference",
    "compiled_reps": 3,
    "sync_branches": (128, 512, 2048),
    "sync_width": 16,
    # (branches, width): 1x, 4x, 16x the tensors at the same scalars per tensor, then 4x the scalars.
    "memory_configs": [(128, 128), (512, 128), (2048, 128), (128, 256)],
    "small_reps": 41,
    "blocks": {512: 15, 2048: 9, 8192: 5},  # tensors: rounds
    "diagnose_reps": 5,
}
QUICK = {
    "eager_reps_reference": 3,
    "eager_reps_wide": 2,
    "wide": {"n_branches": 32, "width": 8, "n_big": 3, "big_dim": 64, "batch_size": 8},
    "compiled_model": "tiny",
    "compiled_reps": 1,
    "sync_branches": (4, 16, 64),
    "sync_width": 4,
    "memory_configs": [(64, 32)],
    "small_reps": 3,
    "blocks": {64: 2, 128: 2, 256: 2},
    "diagnose_reps": 1,
}


@dataclasses.dataclass
class Case:
    """A model to benchmark: instance, terms-mode step, batches, terms."""

    name: str
    model: torch.nn.Module
    step: Callable[..., Any]
    batch: Any
    second_batch: Any
    terms: list[str]

    @property
    def spec(self) -> gradprobe.ProbeSpec:
        # The model instance, not a factory: model construction is not gradprobe's cost and is not
        # timed for the baselines either. Everything else probe() does is timed.
        return gradprobe.ProbeSpec(
            model=self.model,
            step=self.step,
            batch=self.batch,
            second_batch=self.second_batch,
            terms=self.terms,
        )

    @property
    def scenarios(self) -> list[tuple[str, tuple[str, ...]]]:
        return default_scenarios(self.terms)


def reference_case() -> Case:
    spec = reference_spec()  # float64, CPU, terms energy/force/virial
    model = spec.model() if not isinstance(spec.model, torch.nn.Module) else spec.model
    return Case(
        "reference potential", model, spec.step, spec.batch, spec.second_batch, list(spec.terms or ())
    )


def wide_case(n_branches: int, width: int, n_big: int = 0, big_dim: int = 0, batch_size: int = 8) -> Case:
    model, batch = make_wide(n_branches, width, n_big, big_dim, batch_size)
    _, batch2 = make_wide(n_branches, width, n_big, big_dim, batch_size, seed=1)
    name = f"wide ({n_branches} branches{f', batch {batch_size}' if batch_size != 8 else ''})"
    return Case(name, model, wide_step, batch, batch2, list(TERMS))


def _made(name: str, make: Callable[..., Any], step: Callable[..., Any], terms: Any, *args: Any) -> Case:
    """A case from a model maker: its model and batch (seed 0), and the batch of seed 1 as the second."""
    model, batch = make(*args)
    _, batch2 = make(*args, seed=1)
    return Case(name, model, step, batch, batch2, list(terms))


def small_case() -> Case:
    return _made("small functional (10 tensors)", make_small, small_step, SMALL_TERMS)


def mlp_case() -> Case:
    return _made("MLP, BatchNorm, Dropout", make_mlp, mlp_step, MLP_TERMS)


def encoder_case() -> Case:
    return _made("transformer layer (15 tensors)", make_encoder, encoder_step, ENCODER_TERMS)


def blocks_case(tensors: int) -> Case:
    return _made(f"tiny blocks ({tensors // 4} blocks)", make_blocks, blocks_step, BLOCK_TERMS, tensors)


def header(title: str) -> None:
    print(f"\n== {title} ==", flush=True)


def fmt_n(n: float) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else str(int(n))


def same_reach(reached: dict[str, list[str]], fm: gradprobe.FlowMap, variant: str) -> bool:
    return all(set(names) == set(fm.reached(variant, s)) for s, names in reached.items())


# ----------------------------------------------------------------------------------- sections


def eager_timings(case: Case, reps: int) -> dict[str, Any]:
    spec = case.spec
    fns = {
        "probe": lambda: gradprobe.probe(spec),
        "naive": lambda: naive_eager(case.model, case.step, case.batch, case.terms, case.scenarios),
        "floor": lambda: floor_eager(case.model, case.step, case.batch, case.scenarios),
    }
    for fn in fns.values():  # warm-up, untimed
        fn()
    times = interleaved(fns, reps, before=lambda: case.model.zero_grad(set_to_none=True))
    fm = gradprobe.probe(spec)
    reached = naive_eager(case.model, case.step, case.batch, case.terms, case.scenarios)
    case.model.zero_grad(set_to_none=True)
    return {
        **_timed(case, reps, times),
        "agree": same_reach(reached, fm, "eager"),
    }


def _described(case: Case) -> dict[str, Any]:
    """The fields every result row starts with: the model and its size."""
    tensors, scalars = size_of(case.model)
    return {"model": case.name, "tensors": tensors, "scalars": scalars}


def _timed(case: Case, reps: int, times: dict[str, list[float]]) -> dict[str, Any]:
    """A timed row's common fields: the model, the rounds, the best and every time per contender."""
    return {
        **_described(case),
        "scenarios": len(case.scenarios),
        "reps": reps,
        "best": best(times),
        "all": times,
    }


def compiled_timings(case: Case, reps: int) -> dict[str, Any]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    spec = case.spec
    out: dict[str, Any] = {}

    def probe() -> None:
        out["fm"] = gradprobe.probe(spec, variants=COMPILED)
        out.setdefault("probe_every_rep", []).append(out["fm"].variant(COMPILED).compile_count)

    def floor() -> None:
        out["floor_graphs"] = floor_compiled(
            case.model, case.step, case.batch, case.second_batch, case.terms, case.scenarios
        )

    def naive() -> None:
        before = counters["stats"]["unique_graphs"]
        out["naive_reached"], out["naive_per_scenario"] = naive_compiled(
            case.model, case.step, case.batch, case.terms, case.scenarios
        )
        out["naive_unique_graphs"] = counters["stats"]["unique_graphs"] - before
        out.setdefault("naive_every_rep", []).append(out["naive_per_scenario"])

    def fresh() -> None:
        # Every contender starts from an empty dynamo cache (and fresh automatic-dynamic state).
        torch._dynamo.reset()
        case.model.zero_grad(set_to_none=True)

    # Warm-up: the first compile in a process also pays for lazy imports; take it on a tiny model.
    tiny = wide_case(4, 2)
    torch._dynamo.reset()
    floor_compiled(tiny.model, tiny.step, tiny.batch, tiny.second_batch, tiny.terms, tiny.scenarios)

    times = interleaved({"probe": probe, "floor": floor, "naive": naive}, reps, before=fresh)
    fresh()
    fm = out["fm"]
    info = fm.variant(COMPILED)
    return {
        **_timed(case, reps, times),
        "probe_compile_count": info.compile_count,
        "probe_graphs": info.graphs,
        "probe_errors": [r.error.message for r in fm.runs if r.error is not None],
        "floor_graphs": out["floor_graphs"],
        "naive_per_scenario": out["naive_per_scenario"],
        "naive_every_rep": out["naive_every_rep"],
        "probe_every_rep": out["probe_every_rep"],
        "naive_compiles": sum(1 for g in out["naive_per_scenario"] if g),
        "naive_graphs": sum(out["naive_per_scenario"]),
        "naive_unique_graphs": out["naive_unique_graphs"],
        "scenario_names": [name for name, _ in case.scenarios],
        "patterns": [tuple(float_weights(case.terms, on).values()) for _, on in case.scenarios],
        "agree": same_reach(out["naive_reached"], fm, COMPILED),
        "specialize_float": bool(torch._dynamo.config.specialize_float),
        "automatic_dynamic_shapes": bool(torch._dynamo.config.automatic_dynamic_shapes),
    }


def sync_counts(case: Case) -> dict[str, Any]:
    spec = case.spec
    gradprobe.probe(spec)  # warm-up outside the counter
    with SyncCounter() as probe_syncs:
        fm = gradprobe.probe(spec)
    with SyncCounter() as naive_syncs:
        naive_eager(case.model, case.step, case.batch, case.terms, case.scenarios)
    case.model.zero_grad(set_to_none=True)
    k = len(case.scenarios)
    return {
        **_described(case),
        "probe_per_scenario": probe_syncs.total / k,
        "naive_per_scenario": naive_syncs.total / k,
        "probe_counts": dict(probe_syncs.counts),
        "naive_counts": dict(naive_syncs.counts),
        "map_chars": len(fm.to_json()),
    }


def map_size(case: Case) -> dict[str, Any]:
    return {
        **_described(case),
        "map_chars": len(gradprobe.probe(case.spec).to_json()),
    }


def memory_run(kind: str, branches: int, width: int) -> dict[str, Any]:
    cmd = [sys.executable, str(HERE / "memory_worker.py"), kind, str(branches), str(width)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def memory(configs: list[tuple[int, int]]) -> list[dict[str, Any]]:
    jobs = [(kind, n, w) for n, w in configs for kind in ("step", "probe")]
    # Two workers at a time: only memory is measured in them, not time.
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda j: memory_run(*j), jobs))
    rows = []
    for n, w in configs:
        step = next(r for r in results if r["kind"] == "step" and (r["branches"], r["width"]) == (n, w))
        probe = next(r for r in results if r["kind"] == "probe" and (r["branches"], r["width"]) == (n, w))
        rows.append(
            {
                "branches": n,
                "width": w,
                "tensors": probe["tensors"],
                "scalars": probe["scalars"],
                "param_mb": probe["param_mb"],
                "step_extra_mb": step["extra_mb"],
                "probe_extra_mb": probe["extra_mb"],
            }
        )
    return rows


DIAGNOSE_CASES = (
    ("every variant matches", "eager,make_fx[detach=alias]"),
    ("make_fx fails (makefx-detach)", "eager,make_fx"),
)


def eager_step_seconds(case: Case, reps: int) -> float:
    """One eager training step's compute: a forward and a backward of the sum of the terms (min)."""

    def step() -> None:
        values = case.step(case.model, case.batch)
        sum(values.values()).backward()

    times = interleaved({"step": step}, reps, before=lambda: case.model.zero_grad(set_to_none=True))
    case.model.zero_grad(set_to_none=True)
    return best(times)["step"]


def diagnose_timings(
    case: Case,
    reps: int,
    cases: tuple[tuple[str, str], ...] = DIAGNOSE_CASES,
    fresh_compiles: bool = False,
    warm_up: bool = True,
) -> list[dict[str, Any]]:
    """Probe vs probe + diagnose, interleaved, for each variant set of ``cases``; the lineage seconds
    (the probe's own record of them) and the bisection trials of the fastest diagnosing round.

    ``fresh_compiles``: dynamo is reset before each call, so that every round compiles as a user's
    first probe in a fresh process does (the same module compiled round after round piles up
    recompiles, and past dynamo's limit of 8 it silently runs eager: later rounds would measure
    something else)."""
    spec = case.spec
    rows = []

    def before() -> None:
        case.model.zero_grad(set_to_none=True)
        if fresh_compiles:
            torch._dynamo.reset()

    for label, variants in cases:
        out: dict[str, Any] = {}

        def diagnosed(variants: str = variants, out: dict[str, Any] = out) -> None:
            fm = gradprobe.probe(spec, variants=variants, diagnose=True, progress=False)
            lineage = sum(x.get("seconds", 0.0) for x in fm.evidence.get("lineage", {}).values())
            out.setdefault("rounds", []).append((lineage, fm))

        fns = {
            "probe": lambda variants=variants: gradprobe.probe(spec, variants=variants, progress=False),
            "diagnose": diagnosed,
        }
        if warm_up:  # the first trace in a process pays for imports
            for fn in fns.values():
                before()
                fn()
        out.clear()
        times = interleaved(fns, reps, before=before)
        fastest = min(range(len(times["diagnose"])), key=times["diagnose"].__getitem__)
        lineage, fm = out["rounds"][fastest]
        # Each path's recording: its minimum over the rounds (one recording a round, tens of ms: the
        # fastest round's alone swings with the machine's load).
        per_path: dict[str, float] = {}
        for _, round_fm in out["rounds"]:
            for k, x in round_fm.evidence.get("lineage", {}).items():
                per_path[k] = min(per_path.get(k, math.inf), x.get("seconds", 0.0))
        rows.append(
            {
                **_timed(case, reps, times),
                "label": label,
                "variants": variants,
                "lineage": lineage,
                "lineage_per_path": per_path,
                "bisections": len(fm.bisections),
                "trials": sum(len(b.get("trials", [])) for b in fm.bisections),
                "trial_list": [
                    {"bisected": b["variant"], **t} for b in fm.bisections for t in b.get("trials", [])
                ],
                "findings": sorted({f.cause for f in fm.findings}),
                "diagnose_minus_lineage": times["diagnose"][fastest] - lineage,
            }
        )
    before()
    return rows


# Section 8: SchNetPack's model compiled alone, as its users write it (``torch.compile(model)``), and
# traced. The eager backend keeps autograd.grad(create_graph=True) working: every variant matches.
# make_fx stops on a data-dependent value in SchNetPack's own code (``int(idx_m[-1])``): bisected by
# its capture knobs, each trial a trace (cheap). aot_eager raises "does not support double backward"
# on the force and stress terms: bisected by the capture without compile, then the backend ladder.
# (label, variants, rounds, in --quick): a compiled case compiles in every call (dynamo is reset
# before each), seconds a call, so it gets few rounds.
REAL_DIAGNOSE_CASES = (
    ("every variant matches", "eager,compile_model:eager", 2, True),
    ("make_fx fails (data-dependent)", "eager,make_fx", 3, True),
    ("aot_eager fails (double backward)", "eager,compile_model:aot_eager", 1, False),
)


def real_diagnose_timings(case: Case, quick: bool) -> list[dict[str, Any]]:
    """Section 8's rows: ``diagnose_timings`` per case of REAL_DIAGNOSE_CASES, each with its rounds
    (one round and no warm-up in --quick, where the double-backward case is left out).

    The warm-up is one plain probe of the first case: the first compile of the package's code in
    the process costs about a second more than the next (measured: 4.5 s, then 3.2-3.5 s), and with
    a few rounds it would land on whichever contender runs first."""
    rows = []
    if not quick:
        torch._dynamo.reset()
        gradprobe.probe(case.spec, variants=REAL_DIAGNOSE_CASES[0][1], progress=False)
    for label, variants, reps, in_quick in REAL_DIAGNOSE_CASES:
        if quick and not in_quick:
            continue
        rows += diagnose_timings(case, 1 if quick else reps, ((label, variants),), fresh_compiles=True,
                                 warm_up=False)  # fmt: skip
    return rows


def schnetpack_case() -> Case | None:
    from real_package import schnetpack_case_parts

    parts = schnetpack_case_parts()
    if parts is None:
        return None
    model, step, batch, batch2, terms = parts
    return Case("SchNetPack 2.1 (SchNet, 5 atoms)", model, step, batch, batch2, terms)


def scaling_exponent(rows: list[dict[str, Any]], who: str) -> float:
    """Least-squares slope of log(time) against log(tensors): 1 is linear in the parameter tensors."""
    xs = [math.log(r["tensors"]) for r in rows]
    ys = [math.log(r["best"][who]) for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


# ------------------------------------------------------------------------------------- report


def print_eager(rows: list[dict[str, Any]]) -> None:
    print(f"{'model':<32}{'tensors':>8}{'scalars':>9}{'probe s':>10}{'naive s':>10}{'floor s':>10}"
          f"{'naive/probe':>13}{'agree':>7}")  # fmt: skip
    for r in rows:
        b = r["best"]
        print(
            f"{r['model']:<32}{r['tensors']:>8}{fmt_n(r['scalars']):>9}{b['probe']:>10.4f}{b['naive']:>10.4f}"
            f"{b['floor']:>10.4f}{b['naive'] / b['probe']:>12.2f}x{'yes' if r['agree'] else 'NO':>7}"
        )
    print("naive/probe: how many times faster the probe is than the naive loop (min of interleaved runs);")
    print("agree: the naive loop finds the same non-zero parameters per scenario as the probe.")


def print_floor(rows: list[dict[str, Any]], compiled: dict[str, Any]) -> None:
    print(f"{'path':<10}{'model':<32}{'probe s':>10}{'floor s':>10}{'probe/floor':>13}")
    for r in rows:
        b = r["best"]
        print(
            f"{'eager':<10}{r['model']:<32}{b['probe']:>10.4f}{b['floor']:>10.4f}{b['probe'] / b['floor']:>12.2f}x"
        )
    b = compiled["best"]
    print(f"{'compiled':<10}{compiled['model']:<32}{b['probe']:>10.3f}{b['floor']:>10.3f}"
          f"{b['probe'] / b['floor']:>12.2f}x")  # fmt: skip
    k = compiled["scenarios"]
    print(f"eager floor: one forward + {k} autograd.grad (retain_graph), nothing else.")
    print(f"compiled floor: make_fx (detach->alias) + torch.compile(aot_eager) once, then {k}+1 forward and")
    print(f"backward passes ({k} scenarios + the second batch). Compiled variant: {COMPILED}.")


def print_compiles(c: dict[str, Any]) -> None:
    b = c["best"]
    print(f"model: {c['model']}, {c['scenarios']} scenarios, torch {torch.__version__}, "
          f"dynamo specialize_float={c['specialize_float']}, automatic_dynamic_shapes={c['automatic_dynamic_shapes']}")  # fmt: skip
    print(f"{'contender':<52}{'compiles':>9}{'graphs':>8}{'best s':>9}")
    print(
        f"{'gradprobe ' + COMPILED:<52}{c['probe_compile_count']:>9}{c['probe_graphs']:>8}{b['probe']:>9.3f}"
    )
    print(f"{'floor (weights as one 1-D tensor)':<52}{1:>9}{c['floor_graphs']:>8}{b['floor']:>9.3f}")
    print(
        f"{'naive loop (Python-float weights)':<52}{c['naive_compiles']:>9}{c['naive_graphs']:>8}{b['naive']:>9.3f}"
    )
    print("naive loop, graphs compiled per scenario (weights as passed):")
    for name, pattern, g in zip(c["scenario_names"], c["patterns"], c["naive_per_scenario"], strict=True):
        print(f"  {name:<14} weights {pattern}: {g} graph(s){'' if g else ' (no recompile)'}")
    distinct = len(set(c["patterns"]))
    print(f"{distinct} distinct weight patterns -> {c['naive_compiles']} compiles "
          f"(dynamo counters unique_graphs: {c['naive_unique_graphs']}); the probe: "
          f"{c['probe_compile_count']} compile(s) for all.")  # fmt: skip
    print(f"speedup of the compiled probe over the naive compiled loop: {b['naive'] / b['probe']:.2f}x "
          f"(agree on reached parameters: {'yes' if c['agree'] else 'NO'})")  # fmt: skip
    print(
        "compiles = runs during which the backend compiled something; graphs = graphs handed to the backend."
    )
    print(
        f"every round: probe compiles {c['probe_every_rep']}, naive graphs per scenario {c['naive_every_rep']}"
    )
    if c["probe_graphs"] > c["probe_compile_count"]:
        print(f"the probe's one compiling run handed {c['probe_graphs']} graphs to the backend: dynamo compiled "
              "the frame more than once (docs/benchmarks.md: a tensorify restart on float64 weights)")  # fmt: skip
    if c["probe_errors"]:
        print(f"probe run errors: {c['probe_errors']}")


def print_syncs(rows: list[dict[str, Any]], base_tensors: int) -> None:
    print(f"{'model':<26}{'tensors':>8}{'scale':>7}{'probe/scen':>12}{'naive/scen':>12}  probe syncs by op")
    for r in rows:
        scale = f"{r['tensors'] / base_tensors:.0f}x" if r["model"].startswith("wide") else ""
        ops = ", ".join(f"{k}: {v}" for k, v in sorted(r["probe_counts"].items()))
        print(f"{r['model']:<26}{r['tensors']:>8}{scale:>7}{r['probe_per_scenario']:>12.2f}"
              f"{r['naive_per_scenario']:>12.2f}  {ops}")  # fmt: skip
    print("counted: calls that sync on a GPU (see benchmarks/syncs.py), per scenario = total / scenarios.")


def print_memory(rows: list[dict[str, Any]]) -> None:
    print(f"{'tensors':>8}{'scalars':>9}{'params MB':>10}{'step +MB':>10}{'probe +MB':>11}{'probe/step':>11}")
    for r in rows:
        ratio = f"{r['probe_extra_mb'] / r['step_extra_mb']:.2f}x" if r["step_extra_mb"] >= 1 else "n/a"
        print(
            f"{r['tensors']:>8}{fmt_n(r['scalars']):>9}{r['param_mb']:>10.1f}{r['step_extra_mb']:>10.1f}"
            f"{r['probe_extra_mb']:>11.1f}{ratio:>11}"
        )
    print("+MB: peak RSS one run adds over its process after setup (a fresh process per run; see")
    print("benchmarks/memory_worker.py). step: zero_grad, forward, total of all terms, backward, SGD step.")


def print_maps(rows: list[dict[str, Any]]) -> None:
    print(f"{'model':<26}{'tensors':>8}{'scalars':>9}{'map chars':>11}{'chars/tensor':>14}")
    for r in rows:
        print(f"{r['model']:<26}{r['tensors']:>8}{fmt_n(r['scalars']):>9}{r['map_chars']:>11}"
              f"{r['map_chars'] / r['tensors']:>14.1f}")  # fmt: skip
    print("map chars: len(fm.to_json()) of the eager probe. The last row has the first wide row's tensor")
    print("count with 4x the scalars per tensor.")


def print_other(rows: list[dict[str, Any]]) -> None:
    print(f"{'model':<32}{'tensors':>8}{'scalars':>9}{'probe s':>10}{'naive s':>10}{'floor s':>10}"
          f"{'probe/floor':>13}{'naive/probe':>13}{'agree':>7}")  # fmt: skip
    for r in rows:
        b = r["best"]
        print(
            f"{r['model']:<32}{r['tensors']:>8}{fmt_n(r['scalars']):>9}{b['probe']:>10.4f}{b['naive']:>10.4f}"
            f"{b['floor']:>10.4f}{b['probe'] / b['floor']:>12.2f}x{b['naive'] / b['probe']:>12.2f}x"
            f"{'yes' if r['agree'] else 'NO':>7}"
        )
    blocks = [r for r in rows if r["model"].startswith("tiny blocks")]
    if len(blocks) > 1:
        e_probe, e_floor = scaling_exponent(blocks, "probe"), scaling_exponent(blocks, "floor")
        print(f"scaling exponent (slope of log time on log tensors, {blocks[0]['tensors']} -> "
              f"{blocks[-1]['tensors']}): probe {e_probe:.3f}, floor {e_floor:.3f}, naive "
              f"{scaling_exponent(blocks, 'naive'):.3f}")  # fmt: skip
    print("small functional: a convolution, a layer norm and two heads through torch.nn.functional, bare")
    print(
        "nn.Parameter s; MLP: nn.Sequential of Linear, BatchNorm1d, ReLU, Dropout in training mode; transformer"
    )
    print("layer: an embedding, nn.TransformerEncoderLayer and a head; tiny blocks: a ModuleList of (gain,")
    print("offset, Linear(4, 4)) blocks in sequence, outputs stacked (benchmarks/other_models.py). Rounds")
    print("interleaved, minima, as in section 1.")


def print_diagnose(rows: list[dict[str, Any]], step_s: float, model: str = "the reference potential") -> None:
    print(f"{'variants':<30}{'case':<36}{'probe s':>9}{'+diag s':>9}{'lineage s':>11}"
          f"{'(diag-lin)/probe':>18}{'bisections':>12}")  # fmt: skip
    for r in rows:
        b = r["best"]
        print(f"{r['variants']:<30}{r['label']:<36}{b['probe']:>9.4f}{b['diagnose']:>9.4f}{r['lineage']:>11.4f}"
              f"{r['diagnose_minus_lineage'] / b['probe']:>17.2f}x{r['bisections']:>7} ({r['trials']} trials, "
              f"{sum(t.get('seconds', 0.0) for t in r['trial_list']):.2f}s)")  # fmt: skip
    print(f"eager step of {model} (forward + backward of all terms): {step_s:.4f}s")
    for r in rows:
        paths = ", ".join(
            f"{k} {v:.4f}s ({v / step_s:.1f}x a step)" for k, v in r["lineage_per_path"].items()
        )
        print(f"lineage, {r['variants']}: {paths}")
    print("+diag: probe(diagnose=True), the fastest of the interleaved rounds; lineage: the seconds the")
    print("probe records for its lineage recordings (evidence.lineage.*.seconds) in that round (per path:")
    print("each path's fastest recording over the rounds); trials: their recorded seconds in that round;")
    print(f"findings: {'; '.join(r['variants'] + ': ' + ', '.join(r['findings']) for r in rows)}")


def print_trials(rows: list[dict[str, Any]]) -> None:
    """Where bisection time goes: each trial of the fastest diagnosing round, split as the trial
    records it (build: make_fx's trace; compile: dynamo's own compile time; run)."""
    trials = [t for r in rows for t in r["trial_list"]]
    if not trials:
        return
    print(f"{'trial':<58}{'ok':>4}{'s':>8}{'build s':>9}{'compile s':>11}{'run s':>8}  re-used")
    for t in trials:
        cells = "".join(f"{t[k]:>{w}.3f}" if k in t else f"{'-':>{w}}" for k, w in
                        (("build_s", 9), ("compile_s", 11), ("run_s", 8)))  # fmt: skip
        line = (f"{t['bisected'] + ': ' + t['change']:<58.58}{'yes' if t['ok'] else 'no':>4}{t['seconds']:>8.3f}"
                f"{cells}  {t.get('reused', '')}")  # fmt: skip
        print(line.rstrip())
    print("re-used: trace (make_fx's trace shared by trials that change only the compile); measurement (the")
    print("probe's own run of that variant: no build, no compile)")


def requirements(res: dict[str, Any]) -> list[tuple[bool, str]]:
    out = []
    for r in res["eager"]:
        b = r["best"]
        ratio = b["probe"] / b["floor"]
        out.append((ratio <= 1.3, f"eager probe <= 1.3 x floor on {r['model']}: {ratio:.2f}x"))
        out.append((b["probe"] < b["naive"], f"eager probe below the naive loop on {r['model']}: "
                    f"{b['probe']:.4f}s vs {b['naive']:.4f}s ({b['naive'] / b['probe']:.2f}x faster)"))  # fmt: skip
    c = res["compiled"]
    once = all(n == 1 for n in c["probe_every_rep"])
    out.append((once, f"compiled probe compiles once for all {c['scenarios']} scenarios on {c['model']}: "
                f"{c['probe_every_rep']} per round (naive loop: {c['naive_compiles']})"))  # fmt: skip
    speedup = c["best"]["naive"] / c["best"]["probe"]
    need = c["naive_compiles"] / 1.5
    out.append((speedup >= need, f"compiled probe speedup over the naive loop >= naive compiles / 1.5 on {c['model']}: "
                f"{speedup:.2f}x vs {need:.2f}x needed"))  # fmt: skip
    wide = [r for r in res["syncs"] if r["model"].startswith("wide")]
    per = [r["probe_per_scenario"] for r in wide]
    out.append((len(set(per)) == 1, "probe host syncs per scenario constant in the number of parameter tensors: "
                + ", ".join(f"{r['tensors']}: {r['probe_per_scenario']:.2f}" for r in wide)))  # fmt: skip
    maps = res["maps"]
    per_tensor = [m["map_chars"] / m["tensors"] for m in maps[:-1]]
    spread = max(per_tensor) / min(per_tensor)
    scalars_ratio = maps[-1]["map_chars"] / maps[0]["map_chars"]
    ok = spread <= 1.1 and abs(scalars_ratio - 1) <= 0.05
    out.append((ok, "flow-map size proportional to parameter tensors (chars/tensor within 10%): "
                + ", ".join(f"{m['tensors']}: {x:.0f}" for m, x in zip(maps, per_tensor, strict=False))
                + f"; 4x scalars at fixed tensors (within 5%): size x{scalars_ratio:.3f}"))  # fmt: skip
    return out + other_requirements(res) + diagnose_requirements(res)


def _short(row: dict[str, Any]) -> str:
    """A result row's model in a few words for a requirement line: its kind and tensor count."""
    kind = row["model"].split(" (")[0].split(",")[0]
    return f"{kind} {row['tensors']}"


def other_requirements(res: dict[str, Any]) -> list[tuple[bool, str]]:
    """Issue 20: the floor and the naive loop at every size on models unlike the wide one, the scaling
    exponent, and the cost of a diagnosis that finds nothing."""
    out = []
    rows = res["other"]
    ratios = [(r, r["best"]["probe"] / r["best"]["floor"]) for r in rows]
    out.append((all(x <= 1.15 for _, x in ratios), "eager probe <= 1.15 x floor at every size and kind: "
                + ", ".join(f"{_short(r)} {x:.2f}x" for r, x in ratios)))  # fmt: skip
    faster = [(r, r["best"]["naive"] / r["best"]["probe"]) for r in rows]
    out.append((all(x > 1 for _, x in faster), "eager probe faster than the naive loop at every size and kind: "
                + ", ".join(f"{_short(r)} {x:.2f}x faster" for r, x in faster)))  # fmt: skip
    blocks = [r for r in rows if r["model"].startswith("tiny blocks")]
    e_probe, e_floor = scaling_exponent(blocks, "probe"), scaling_exponent(blocks, "floor")
    out.append((abs(e_probe - e_floor) <= 0.1 * e_floor, f"probe scaling exponent within 10% of the floor's "
                f"({blocks[0]['tensors']} -> {blocks[-1]['tensors']} tensors): {e_probe:.3f} vs {e_floor:.3f} "
                f"({(e_probe / e_floor - 1) * 100:+.1f}%)"))  # fmt: skip
    clean = res["diagnose"][0]
    ratio = clean["diagnose_minus_lineage"] / clean["best"]["probe"]
    out.append((ratio <= 1.5, f"diagnose <= 1.5 x the probe when every variant matches ({clean['variants']}), "
                f"lineage excluded: {ratio:.2f}x ({clean['bisections']} bisections; lineage "
                f"{clean['lineage']:.4f}s on its own)"))  # fmt: skip
    return out


def diagnose_requirements(res: dict[str, Any]) -> list[tuple[bool, str]]:
    """Issue 20, item 2: the lineage recording, one recorded step per path, costs at most 10 eager
    steps of the model, on the reference potential and on the real package; a diagnosis of the real
    package that finds nothing costs at most 1.5 probes, lineage excluded."""
    out = []
    models = [("reference potential", res["diagnose"], res["eager_step"])]
    if "diagnose_real" in res:
        models.append((res["real_model"], res["diagnose_real"], res["eager_step_real"]))
    for name, rows, step_s in models:
        ratios: dict[str, float] = {}  # path -> its slowest recording over the cases (eager is in each)
        for r in rows:
            for k, v in r["lineage_per_path"].items():
                ratios[k] = max(ratios.get(k, 0.0), v / step_s)
        worst = max(ratios.values(), default=0.0)
        out.append((worst <= 10, f"lineage recording <= 10x an eager step per path on {name}: worst {worst:.1f}x ("
                    + ", ".join(f"{k} {x:.1f}x" for k, x in ratios.items()) + ")"))  # fmt: skip
    if "diagnose_real" in res:
        clean = res["diagnose_real"][0]
        ratio = clean["diagnose_minus_lineage"] / clean["best"]["probe"]
        out.append((ratio <= 1.5, f"diagnose <= 1.5 x the probe when every variant matches on {res['real_model']} "
                    f"({clean['variants']}), lineage excluded: {ratio:.2f}x ({clean['bisections']} bisections)"))  # fmt: skip
    return out


def profile_probe(cfg: dict[str, Any], model: str = "wide", top: int = 20) -> None:
    """cProfile of one eager probe and one floor (``model``: wide, small, or blocks at the largest
    size): where the probe's extra time goes."""
    import cProfile
    import pstats

    if model == "small":
        case = small_case()
    elif model == "blocks":
        case = blocks_case(max(cfg["blocks"]))
    else:
        case = wide_case(**cfg["wide"])
    spec = case.spec
    gradprobe.probe(spec)  # warm-up
    for name, fn in (
        ("probe", lambda: gradprobe.probe(spec)),
        ("floor", lambda: floor_eager(case.model, case.step, case.batch, case.scenarios)),
    ):
        header(f"profile: {name}, {case.name}")
        prof = cProfile.Profile()
        prof.enable()
        fn()
        prof.disable()
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(top)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run with tiny sizes (about half a minute, numbers meaningless)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the raw results as JSON")
    parser.add_argument(
        "--wide-batch",
        type=int,
        metavar="N",
        help="batch size of the wide model (default 8): more compute per parameter",
    )
    parser.add_argument(
        "--profile",
        nargs="?",
        const="wide",
        choices=("wide", "small", "blocks"),
        help="only profile one eager probe and one floor on one model (default: the wide model)",
    )
    args = parser.parse_args()
    cfg = QUICK if args.quick else FULL
    if args.wide_batch:
        cfg = {**cfg, "wide": {**cfg["wide"], "batch_size": args.wide_batch}}
    if args.profile:
        torch.set_num_threads(1)
        profile_probe(cfg, args.profile)
        return 0
    torch.set_num_threads(1)
    start = time.perf_counter()
    print(
        f"gradprobe {gradprobe.__version__} benchmark{' (--quick: tiny sizes, numbers meaningless)' if args.quick else ''}"
    )
    print(f"gradprobe from {Path(gradprobe.__file__).parent}")
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPU cores, "
          f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")  # fmt: skip

    res: dict[str, Any] = {"quick": args.quick, "torch": torch.__version__}
    ref = reference_case()
    wide = wide_case(**cfg["wide"])
    res["eager"] = [
        eager_timings(ref, cfg["eager_reps_reference"]),
        eager_timings(wide, cfg["eager_reps_wide"]),
    ]
    del wide

    header("1. probe vs naive loop (eager)")
    print_eager(res["eager"])

    compiled_case = ref if cfg["compiled_model"] == "reference" else wide_case(4, 2)
    res["compiled"] = compiled_timings(compiled_case, cfg["compiled_reps"])

    header("2. probe vs floor")
    print_floor(res["eager"], res["compiled"])

    header("3. compiles per compiled variant")
    print_compiles(res["compiled"])

    header("4. host syncs per scenario")
    base = 2 * cfg["sync_branches"][0]
    res["syncs"] = [sync_counts(ref)] + [
        sync_counts(wide_case(n, cfg["sync_width"])) for n in cfg["sync_branches"]
    ]
    print_syncs(res["syncs"], base)

    header("5. memory and flow-map size")
    res["memory"] = memory(cfg["memory_configs"])
    print_memory(res["memory"])
    print()
    more = map_size(wide_case(cfg["sync_branches"][0], 2 * cfg["sync_width"]))  # 4x the scalars per tensor
    res["maps"] = [r for r in res["syncs"] if r["model"].startswith("wide")] + [more]
    print_maps(res["maps"])

    header("6. other model shapes (eager)")
    res["other"] = [eager_timings(case(), cfg["small_reps"]) for case in (small_case, mlp_case, encoder_case)]
    for tensors, reps in cfg["blocks"].items():
        res["other"].append(eager_timings(blocks_case(tensors), reps))
    print_other(res["other"])

    header("7. diagnose time (reference potential)")
    res["diagnose"] = diagnose_timings(ref, cfg["diagnose_reps"])
    res["eager_step"] = eager_step_seconds(ref, 3 * cfg["diagnose_reps"])
    print_diagnose(res["diagnose"], res["eager_step"])

    header("8. diagnose time (real package)")
    section_start = time.perf_counter()
    real = schnetpack_case()
    if real is None:
        print("skipped: SchNetPack is not installed (scripts/install-real-packages.sh installs it)")
    else:
        res["diagnose_real"] = real_diagnose_timings(real, args.quick)
        res["eager_step_real"] = eager_step_seconds(real, 15)
        res["real_model"] = real.name
        print_diagnose(res["diagnose_real"], res["eager_step_real"], real.name)
        print()
        print_trials(res["diagnose_real"])
        print("dynamo is reset before every call (each round compiles as a first probe in a fresh process")
        print("does); rounds: " + ", ".join(f"{r['variants']} {r['reps']}" for r in res["diagnose_real"]))
        print(f"section 8 took {time.perf_counter() - section_start:.0f}s")
        del real

    header("requirements")
    checks = requirements(res)
    for ok, text in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
    res["requirements"] = [{"pass": ok, "text": text} for ok, text in checks]
    print(f"\ntotal {time.perf_counter() - start:.0f}s, load average {os.getloadavg()[0]:.2f}")
    if args.json:
        for r in res["eager"] + [res["compiled"]]:
            r.pop("fm", None)
        Path(args.json).write_text(json.dumps(res, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
