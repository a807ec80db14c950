"""A/B of the eager probe on section 6's small models: two gradprobe source trees, alternating processes.

    python benchmarks/ab_small.py OLD/src NEW/src              # 3 pairs of processes, 41 rounds each
    python benchmarks/ab_small.py OLD/src NEW/src --pairs 5

Each process measures the three small models as section 6 of ``bench_probe.py`` does (the probe, the
naive loop and the floor in interleaved rounds, ``gc.collect()`` before each call, minima) with one
tree on ``PYTHONPATH``; the processes alternate A B A B ..., so that slow phases of the machine fall on
both trees. Printed per model: probe / floor of every process, the mean of each tree, and the mean of
the per-pair differences of probe / floor with their range.

Why processes, not two code paths in one process: alternating two paths there makes each path's code
colder than it is when a probe runs on its own. A rewrite of the small-model reductions measured 200 us
faster per probe that way (paired, 300 rounds), and no faster in alternating processes (2% warm, within
noise cold): the in-process difference was the other path's code evicting this one's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(reps: int) -> None:
    sys.path.insert(0, str(HERE))
    import torch

    torch.set_num_threads(1)
    import bench_probe as bp

    import gradprobe

    rows = []
    for make in (bp.small_case, bp.mlp_case, bp.encoder_case):
        case = make()
        best = bp.eager_timings(case, reps)["best"]
        rows.append({"model": case.name, "probe": best["probe"], "floor": best["floor"]})
    print(json.dumps({"gradprobe": gradprobe.__file__, "rows": rows}))


def measure(src: str, reps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", "--reps", str(reps)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"the process for {src} failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = Path(src).resolve() / "gradprobe" / "__init__.py"
    if Path(out["gradprobe"]).resolve() != expected:
        raise SystemExit(f"{src} was not the gradprobe measured: {out['gradprobe']}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("a", nargs="?", help="tree A's src directory (the one holding gradprobe/)")
    parser.add_argument("b", nargs="?", help="tree B's src directory")
    parser.add_argument("--pairs", type=int, default=3, help="pairs of processes (default 3)")
    parser.add_argument("--reps", type=int, default=41, help="interleaved rounds per model (default 41)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.reps)
        return 0
    if not (args.a and args.b):
        parser.error("give two src directories, A and B")
    ratios: dict[str, dict[str, list[float]]] = {}
    for k in range(args.pairs):
        for tree, src in (("A", args.a), ("B", args.b)):
            for row in measure(src, args.reps)["rows"]:
                ratios.setdefault(row["model"], {"A": [], "B": []})[tree].append(row["probe"] / row["floor"])
        print(f"pair {k + 1}/{args.pairs} done", file=sys.stderr, flush=True)
    print(f"A = {args.a}\nB = {args.b}\n{args.pairs} pairs of processes, {args.reps} rounds each")
    print(f"{'model':<34}{'probe/floor, A (mean)':>30}{'probe/floor, B (mean)':>32}   B - A (range)")
    for model, by in ratios.items():
        diffs = [b - a for a, b in zip(by["A"], by["B"], strict=True)]
        mean_a, mean_b = sum(by["A"]) / len(by["A"]), sum(by["B"]) / len(by["B"])
        print(
            f"{model:<34}{' '.join(f'{r:.3f}' for r in by['A']):>20} ({mean_a:.3f})  "
            f"{' '.join(f'{r:.3f}' for r in by['B']):>20} ({mean_b:.3f})  "
            f"   {sum(diffs) / len(diffs):+.3f} ({min(diffs):+.3f}..{max(diffs):+.3f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
