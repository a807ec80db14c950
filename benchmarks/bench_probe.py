"""What a probe costs, against the naive loop and against the floor, and the requirements of issue 35.

    python benchmarks/bench_probe.py            # full run (several minutes on 2 cores)
    python benchmarks/bench_probe.py --quick    # smoke run with tiny sizes (numbers meaningless)
    python benchmarks/bench_probe.py --json out.json   # also every round's time, as JSON

Sections:
  1. probe, naive loop and floor (eager) on the reference potential, the wide model, three small
     models and tiny blocks at 512 / 2,048 / 8,192 tensors (benchmarks/other_models.py); the scaling
     exponents over the tiny blocks.
  2. compiles of the compiled variant, for all scenarios together.
  3. host syncs per scenario at 1x, 4x, 16x the parameter tensors, and the flow map's size.
  4. diagnose when nothing fails (reference potential), its lineage and gradients checks apart.
Then one PASS/FAIL line per requirement. Timings: one thread, interleaved rounds (A B C A B C ...)
after an untimed warm-up round, gc.collect() before every call, the median of each contender's
rounds. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import other_models as om  # noqa: E402
from baselines import default_scenarios, floor_eager, naive_eager  # noqa: E402
from syncs import SyncCounter  # noqa: E402
from wide_model import TERMS, make_wide, size_of, wide_step  # noqa: E402

import gradprobe  # noqa: E402
from gradprobe.zoo import reference_spec  # noqa: E402

COMPILED = "make_fx[detach=alias]+compile:aot_eager"
DIAGNOSED = "eager,make_fx[detach=alias]"  # every variant matches on the reference potential

FULL = {
    "wide": {"n_branches": 2048, "width": 16, "n_big": 3, "big_dim": 4096, "batch_size": 8},
    "rounds": {"reference": 15, "wide": 7, "small": 21},
    "blocks": {512: 11, 2048: 7, 8192: 7},  # tensors: rounds
    "sync_branches": (128, 512, 2048),
    "sync_width": 16,
    "diagnose_rounds": 5,
}
QUICK = {
    "wide": {"n_branches": 32, "width": 8, "n_big": 3, "big_dim": 64, "batch_size": 8},
    "rounds": {"reference": 3, "wide": 3, "small": 3},
    "blocks": {64: 3, 128: 3, 256: 3},
    "sync_branches": (4, 16, 64),
    "sync_width": 4,
    "diagnose_rounds": 1,
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
        # The model instance, not a factory: building the model is not gradprobe's cost and is not
        # timed for the baselines either. Everything else probe() does is timed.
        fields = ("model", "step", "batch", "second_batch", "terms")
        return gradprobe.ProbeSpec(**{f: getattr(self, f) for f in fields})

    @property
    def scenarios(self) -> list[tuple[str, tuple[str, ...]]]:
        return default_scenarios(self.terms)

    def clear(self) -> None:
        self.model.zero_grad(set_to_none=True)


def reference_case() -> Case:
    spec = reference_spec()  # float64, CPU, terms energy/force/virial
    model = spec.model if isinstance(spec.model, torch.nn.Module) else spec.model()
    return Case(
        "reference potential", model, spec.step, spec.batch, spec.second_batch, list(spec.terms or ())
    )


def _made(name: str, make: Callable[..., Any], step: Callable[..., Any], terms: Any, *args: Any) -> Case:
    """A case from a model maker: its model and batch (seed 0), and the batch of seed 1 as the second."""
    model, batch = make(*args)
    _, batch2 = make(*args, seed=1)
    return Case(name, model, step, batch, batch2, list(terms))


def wide_case(n_branches: int, width: int, n_big: int = 0, big_dim: int = 0, batch_size: int = 8) -> Case:
    name = f"wide ({n_branches} branches)"
    return _made(name, make_wide, wide_step, TERMS, n_branches, width, n_big, big_dim, batch_size)


def blocks_case(tensors: int) -> Case:
    return _made(
        f"tiny blocks ({tensors // 4} blocks)", om.make_blocks, om.blocks_step, om.BLOCK_TERMS, tensors
    )


def small_cases() -> list[Case]:
    return [
        _made("small functional", om.make_small, om.small_step, om.SMALL_TERMS),
        _made("MLP, BatchNorm, Dropout", om.make_mlp, om.mlp_step, om.MLP_TERMS),
        _made("transformer layer", om.make_encoder, om.encoder_step, om.ENCODER_TERMS),
    ]


# ------------------------------------------------------------------------------------ measuring


def interleaved(fns: Mapping[str, Callable[[], Any]], rounds: int, before: Callable[[], None]) -> dict:
    """Seconds per call of each function: an untimed warm-up round, then ``rounds`` rounds A B C A B C.
    ``before`` runs untimed before every call, then ``gc.collect()``."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(rounds + 1):
        for name, fn in fns.items():
            before()
            gc.collect()
            start = time.perf_counter()
            fn()
            if i:
                times[name].append(time.perf_counter() - start)
    return times


def medians(times: Mapping[str, list[float]]) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in times.items()}


def described(case: Case) -> dict[str, Any]:
    tensors, scalars = size_of(case.model)
    return {"model": case.name, "tensors": tensors, "scalars": scalars, "scenarios": len(case.scenarios)}


def same_reach(reached: dict[str, list[str]], fm: gradprobe.FlowMap, variant: str) -> bool:
    return all(set(names) == set(fm.reached(variant, s)) for s, names in reached.items())


def eager_row(case: Case, rounds: int) -> dict[str, Any]:
    spec = case.spec
    fns = {
        "probe": lambda: gradprobe.probe(spec),
        "naive": lambda: naive_eager(case.model, case.step, case.batch, case.terms, case.scenarios),
        "floor": lambda: floor_eager(case.model, case.step, case.batch, case.scenarios),
    }
    times = interleaved(fns, rounds, before=case.clear)
    fm = gradprobe.probe(spec)
    reached = naive_eager(case.model, case.step, case.batch, case.terms, case.scenarios)
    case.clear()
    return {**described(case), "rounds": rounds, "median": medians(times), "all": times,
            "agree": same_reach(reached, fm, "eager")}  # fmt: skip


def scaling_exponent(rows: list[dict[str, Any]], who: str) -> float:
    """Least-squares slope of log(median time) against log(tensors): 1 is linear in the tensors."""
    xs = [math.log(r["tensors"]) for r in rows]
    ys = [math.log(r["median"][who]) for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def compiles(case: Case) -> dict[str, Any]:
    """The probe's compiled variant from a fresh dynamo: compiles and graphs over all scenarios."""
    import torch._dynamo

    torch._dynamo.reset()
    fm = gradprobe.probe(case.spec, variants=COMPILED, progress=False)
    torch._dynamo.reset()
    case.clear()
    info = fm.variant(COMPILED)
    return {**described(case), "probe_compiles": info.compile_count, "probe_graphs": info.graphs,
            "errors": [r.error.message for r in fm.runs if r.error is not None]}  # fmt: skip


def sync_row(case: Case) -> dict[str, Any]:
    spec = case.spec
    gradprobe.probe(spec)  # warm-up outside the counter
    with SyncCounter() as probe_syncs:
        fm = gradprobe.probe(spec)
    with SyncCounter() as naive_syncs:
        naive_eager(case.model, case.step, case.batch, case.terms, case.scenarios)
    case.clear()
    k = len(case.scenarios)
    return {**described(case), "probe_per_scenario": probe_syncs.total / k,
            "naive_per_scenario": naive_syncs.total / k, "probe_counts": dict(probe_syncs.counts),
            "map_chars": len(fm.to_json())}  # fmt: skip


def recorded_seconds(found: Any) -> float:
    """The seconds a check records in the flow map: its ``seconds``, or the sum over its parts' (per path)."""
    if not isinstance(found, dict):
        return 0.0
    if isinstance(found.get("seconds"), int | float):
        return float(found["seconds"])
    return sum(recorded_seconds(v) for v in found.values())


def diagnose_row(case: Case, rounds: int) -> dict[str, Any]:
    """Probe vs probe(diagnose=True), interleaved; the lineage and gradients checks' own seconds per round."""
    spec = case.spec
    maps: list[gradprobe.FlowMap] = []
    fns = {
        "probe": lambda: gradprobe.probe(spec, variants=DIAGNOSED, progress=False),
        "diagnose": lambda: maps.append(
            gradprobe.probe(spec, variants=DIAGNOSED, diagnose=True, progress=False)
        ),
    }
    times = interleaved(fns, rounds, before=case.clear)
    case.clear()
    timed = maps[1:]  # the warm-up round's map is not timed
    lineage = [recorded_seconds(fm.evidence.get("lineage")) for fm in timed]
    grads = [fm.evidence.get("gradients", fm.checks.get("gradients")) for fm in timed]
    gradients = None if grads[0] is None else [recorded_seconds(g) for g in grads]
    rest = [
        d - a - b for d, a, b in zip(times["diagnose"], lineage, gradients or [0.0] * rounds, strict=True)
    ]
    return {**described(case), "variants": DIAGNOSED, "rounds": rounds, "median": medians(times), "all": times,
            "lineage": statistics.median(lineage), "gradients": gradients and statistics.median(gradients),
            "without_checks": statistics.median(rest), "bisections": len(timed[-1].bisections),
            "findings": sorted({f"{f.cause} ({f.severity})" for f in timed[-1].findings})}  # fmt: skip


# ------------------------------------------------------------------------------------- report


def header(title: str) -> None:
    print(f"\n== {title} ==", flush=True)


def fmt_n(n: float) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else str(int(n))


def allowed(row: dict[str, Any]) -> float:
    """The new line's budget for the probe, in seconds: 1.15 x the floor + 1 ms."""
    return 1.15 * row["median"]["floor"] + 1e-3


def print_eager(rows: list[dict[str, Any]]) -> None:
    print(f"{'model':<28}{'tensors':>8}{'scalars':>9}{'probe ms':>10}{'naive ms':>10}{'floor ms':>10}"
          f"{'allowed ms':>12}{'probe/floor':>13}{'naive/probe':>13}{'agree':>7}")  # fmt: skip
    for r in rows:
        m = r["median"]
        print(f"{r['model']:<28}{r['tensors']:>8}{fmt_n(r['scalars']):>9}{m['probe'] * 1e3:>10.3f}"
              f"{m['naive'] * 1e3:>10.3f}{m['floor'] * 1e3:>10.3f}{allowed(r) * 1e3:>12.3f}"
              f"{m['probe'] / m['floor']:>12.2f}x{m['naive'] / m['probe']:>12.2f}x{'yes' if r['agree'] else 'NO':>7}")  # fmt: skip
    blocks = [r for r in rows if r["model"].startswith("tiny blocks")]
    print(f"scaling exponent (slope of log time on log tensors, tiny blocks {blocks[0]['tensors']} -> "
          f"{blocks[-1]['tensors']}): " + ", ".join(f"{w} {scaling_exponent(blocks, w):.3f}" for w in
          ("probe", "floor", "naive")))  # fmt: skip
    print(
        "medians of interleaved rounds (" + ", ".join(str(r["rounds"]) for r in rows) + "); allowed: 1.15 x"
    )
    print("floor + 1 ms; agree: the naive loop finds the same non-zero parameters per scenario as the probe.")


def print_compiles(c: dict[str, Any]) -> None:
    print(f"{c['model']}, {c['scenarios']} scenarios, {COMPILED}: {c['probe_compiles']} compile(s), "
          f"{c['probe_graphs']} graph(s) handed to the backend{'; errors: ' if c['errors'] else ''}"
          + "; ".join(c["errors"]))  # fmt: skip
    print("compiles: runs during which the backend compiled (the naive loop with Python-float weights")
    print("compiles once per distinct weight pattern: docs/benchmarks.md).")


def print_syncs(rows: list[dict[str, Any]]) -> None:
    print(f"{'model':<26}{'tensors':>8}{'probe/scen':>12}{'naive/scen':>12}{'map chars':>11}{'per tensor':>12}"
          "  probe syncs by op")  # fmt: skip
    for r in rows:
        ops = ", ".join(f"{k}: {v}" for k, v in sorted(r["probe_counts"].items()))
        print(f"{r['model']:<26}{r['tensors']:>8}{r['probe_per_scenario']:>12.2f}{r['naive_per_scenario']:>12.2f}"
              f"{r['map_chars']:>11}{r['map_chars'] / r['tensors']:>12.1f}  {ops}")  # fmt: skip
    print("counted: calls that sync on a GPU (benchmarks/syncs.py), per scenario = total / scenarios;")
    print("map chars: len(fm.to_json()) of the eager probe.")


def print_diagnose(d: dict[str, Any]) -> None:
    m = d["median"]
    print(f"{d['model']}, variants {d['variants']}, {d['rounds']} rounds: probe {m['probe'] * 1e3:.1f} ms, "
          f"probe(diagnose=True) {m['diagnose'] * 1e3:.1f} ms, without its lineage and gradients checks "
          f"{d['without_checks'] * 1e3:.1f} ms; bisections {d['bisections']}; findings: "
          f"{', '.join(d['findings']) or 'none'}")  # fmt: skip


def checks_apart(d: dict[str, Any]) -> list[str]:
    """The diagnosis's lineage and gradients checks, each on its own line (seconds as the flow map records)."""
    probe, grads = d["median"]["probe"], d["gradients"]
    found = "not measured (no 'gradients' in fm.evidence or fm.checks)"
    if grads is not None:
        found = f"{grads * 1e3:.1f} ms ({grads / probe:.2f}x the probe)"
    return [
        f"lineage check on its own: {d['lineage'] * 1e3:.1f} ms ({d['lineage'] / probe:.2f}x the probe)",
        f"gradients check on its own: {found}",
    ]


def _short(row: dict[str, Any]) -> str:
    """A row's model in a few words: its kind and tensor count."""
    return f"{row['model'].split(' (')[0].split(',')[0]} {row['tensors']}"


def requirements(res: dict[str, Any]) -> list[tuple[bool, str]]:
    rows, out = res["eager"], []
    within = [(r, r["median"]["probe"], allowed(r)) for r in rows]
    out.append((all(p <= a for _, p, a in within), "probe <= 1.15 x floor + 1 ms on every model (probe / allowed "
                "ms): " + ", ".join(f"{_short(r)} {p * 1e3:.2f}/{a * 1e3:.2f}" for r, p, a in within)))  # fmt: skip
    faster = [(r, r["median"]["naive"] / r["median"]["probe"]) for r in rows]
    out.append((all(x > 1 for _, x in faster), "probe faster than the naive loop on every model: "
                + ", ".join(f"{_short(r)} {x:.2f}x" for r, x in faster)))  # fmt: skip
    blocks = [r for r in rows if r["model"].startswith("tiny blocks")]
    e_probe, e_floor = scaling_exponent(blocks, "probe"), scaling_exponent(blocks, "floor")
    out.append((abs(e_probe - e_floor) <= 0.1 * e_floor, f"probe scaling exponent within 10% of the floor's "
                f"({blocks[0]['tensors']} -> {blocks[-1]['tensors']} tensors): {e_probe:.3f} vs {e_floor:.3f} "
                f"({(e_probe / e_floor - 1) * 100:+.1f}%)"))  # fmt: skip
    c = res["compiled"]
    out.append((c["probe_compiles"] == 1, f"compiled probe compiles once for all {c['scenarios']} scenarios on "
                f"{c['model']}: {c['probe_compiles']}"))  # fmt: skip
    wide = [r for r in res["syncs"] if r["model"].startswith("wide")]
    out.append((len({r["probe_per_scenario"] for r in wide}) == 1, "probe host syncs per scenario constant in the "
                "number of parameter tensors: " + ", ".join(f"{r['tensors']}: {r['probe_per_scenario']:.2f}"
                                                             for r in wide)))  # fmt: skip
    d = res["diagnose"]
    ratio = d["without_checks"] / d["median"]["probe"]
    out.append((ratio <= 1.5 and d["bisections"] == 0, f"diagnose <= 1.5 x the probe when nothing fails on "
                f"{d['model']} ({d['variants']}), lineage and gradients checks apart: {ratio:.2f}x "
                f"({d['median']['diagnose'] / d['median']['probe']:.2f}x with them; {d['bisections']} bisections)"))  # fmt: skip
    return out


def source_commit() -> str:
    """``git describe --always --dirty`` of the tree gradprobe was imported from, if it is a checkout."""
    where = Path(gradprobe.__file__).parent
    try:
        done = subprocess.run(["git", "-C", str(where), "describe", "--always", "--dirty"],
                              capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
    except OSError:
        return "unknown"
    return done.stdout.strip() or "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes (numbers meaningless)")
    parser.add_argument("--json", metavar="PATH", help="also write the raw results (every round) as JSON")
    args = parser.parse_args()
    cfg = QUICK if args.quick else FULL
    torch.set_num_threads(1)
    start = time.perf_counter()
    quick = " (--quick: tiny sizes, numbers meaningless)" if args.quick else ""
    print(f"gradprobe {gradprobe.__version__} benchmark{quick}")
    print(f"gradprobe from {Path(gradprobe.__file__).parent} (commit {source_commit()})")
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPU cores, "
          f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    res: dict[str, Any] = {"quick": args.quick, "torch": torch.__version__, "commit": source_commit()}

    header("1. probe, naive loop and floor (eager)")
    rounds = cfg["rounds"]
    ref = reference_case()
    res["eager"] = [eager_row(ref, rounds["reference"]), eager_row(wide_case(**cfg["wide"]), rounds["wide"])]
    res["eager"] += [eager_row(case, rounds["small"]) for case in small_cases()]
    res["eager"] += [eager_row(blocks_case(tensors), n) for tensors, n in cfg["blocks"].items()]
    print_eager(res["eager"])

    header("2. compiles per compiled variant")
    res["compiled"] = compiles(wide_case(4, 2) if args.quick else ref)
    print_compiles(res["compiled"])

    header("3. host syncs per scenario, flow-map size")
    res["syncs"] = [sync_row(ref)] + [sync_row(wide_case(n, cfg["sync_width"])) for n in cfg["sync_branches"]]
    print_syncs(res["syncs"])

    header("4. diagnose when nothing fails")
    res["diagnose"] = diagnose_row(ref, cfg["diagnose_rounds"])
    print_diagnose(res["diagnose"])

    header("requirements")
    checks = requirements(res)
    for ok, text in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
    for line in checks_apart(res["diagnose"]):
        print(f"      {line}")
    res["requirements"] = [{"pass": ok, "text": text} for ok, text in checks]
    print(f"\ntotal {time.perf_counter() - start:.0f}s, load average {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
