"""Saved flow maps at scale: reading, reporting and diffing a 200 MB map, and the reader's memory.

    python benchmarks/bench_scale.py                 # 137,000 parameters, about 200 MB (a few minutes)
    python benchmarks/bench_scale.py --params 20000  # smaller

Prints the seconds of each step (``gradprobe report``, ``report --html --markdown``, ``diff``, each run
in-process through ``gradprobe.cli.main``), the reader's peak memory (``tracemalloc``: JSON is Python
objects) as a multiple of the file size, for the map and for files of nested empty arrays and other
hostile shapes of the same size, and one PASS/FAIL line per requirement (issue 18: a 200 MB map
reported in under 30 s; the reader within 10x the file size).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from large_map import synthetic_map

from gradprobe.cli import main
from gradprobe.errors import FlowMapFormatError
from gradprobe.flowmap import FlowMap


def timed(label: str, call: object) -> float:
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        call()  # type: ignore[operator]
    seconds = time.perf_counter() - start
    print(f"{label:<44} {seconds:8.1f} s", flush=True)
    return seconds


def read_peak(path: Path) -> tuple[float, str]:
    tracemalloc.start()
    try:
        FlowMap.from_json(path)
        outcome = "read"
    except FlowMapFormatError as e:
        outcome = "refused: " + str(e).split(": ", 1)[1][:70]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak / path.stat().st_size, outcome


def main_() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=137_000)
    parser.add_argument("--hostile-mb", type=float, default=20.0, help="size of each hostile file")
    args = parser.parse_args()
    verdicts = []
    with tempfile.TemporaryDirectory(prefix="gradprobe-scale-") as tmp:
        a_path, b_path = Path(tmp) / "before.json", Path(tmp) / "after.json"
        start = time.perf_counter()
        synthetic_map(args.params).to_json(a_path)
        synthetic_map(args.params, seed=1, changed_every=7).to_json(b_path)
        size = b_path.stat().st_size
        print(
            f"{args.params:,} parameters, {size / 1e6:.0f} MB per map (written in {time.perf_counter() - start:.0f} s)"
        )
        report = timed("gradprobe report after.json", lambda: main(["report", str(b_path)]))
        timed(
            "gradprobe report --html --markdown",
            lambda: main(["report", str(b_path), "--html", f"{tmp}/r.html", "--markdown", f"{tmp}/r.md"]),
        )
        diff = timed(
            "gradprobe diff before.json after.json", lambda: main(["diff", str(a_path), str(b_path)])
        )
        factor, outcome = read_peak(b_path)
        print(f"{'reader peak, the map':<44} {factor:8.1f} x the file size ({outcome})")
        worst = factor
        n = int(args.hostile_mb * 1e6)
        head = '{"schema": "gradprobe.flowmap/1", "x": ['
        for item in ("[]", "{}", '{"a": 1}', '"ab"', "[1.5]", "1.5"):
            path = Path(tmp) / "hostile.json"
            path.write_text(head + ",".join([item] * (n // (len(item) + 1))) + "]}")
            factor, outcome = read_peak(path)
            worst = max(worst, factor)
            print(
                f"{'reader peak, ' + str(args.hostile_mb) + ' MB of ' + item:<44} {factor:8.1f} x ({outcome})"
            )
            os.unlink(path)
    full = args.params >= 137_000
    verdicts.append(("report of a 200 MB map in under 30 s", report < 30 or not full))
    verdicts.append(("diff of two 200 MB maps in under 30 s", diff < 30 or not full))
    verdicts.append(("reader within 10x the file size", worst <= 10))
    print("== requirements ==")
    for text, ok in verdicts:
        print(
            f"{'PASS' if ok else 'FAIL'}: {text}"
            + ("" if full else " (not the full size: timing not judged)")
        )
    return 0 if all(ok for _, ok in verdicts) else 1


if __name__ == "__main__":
    raise SystemExit(main_())
