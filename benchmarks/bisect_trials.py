"""Where bisection time goes: every trial of each bisection, with the split each trial records.

    python benchmarks/bisect_trials.py            # the zoo bugs that bisect, then SchNetPack
    python benchmarks/bisect_trials.py zoo        # only the zoo

One ``probe(..., diagnose=True)`` per case, one after the other in one process, dynamo reset between
(single calls, not interleaved rounds: a trial of a compiled path is seconds, the split is what
matters). Per trial: seconds, build (make_fx's trace), compile (dynamo's own compile time), run, and
what it re-used (``trace``, ``measurement``, ``trial``). docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gradprobe
from gradprobe.zoo import reference_spec

ZOO = (
    "trace-eval-mode",
    "makefx-detach",
    "double-backward-unsupported",
    "backend-drops-grads",
    "norm-mismatch",
)


def show(label: str, fm: gradprobe.FlowMap, seconds: float) -> None:
    print(f"## {label}: probe + diagnose {seconds:.2f}s", flush=True)
    for b in fm.bisections:
        total = sum(t.get("seconds", 0.0) for t in b["trials"])
        culprit = (b["culprit"] or {}).get("change")
        print(f"  bisection of {b['variant']}: {len(b['trials'])} trials, {total:.2f}s; culprit: {culprit}")
        for t in b["trials"]:
            split = "  ".join(
                f"{k[:-2]} {t[k]:.3f}" if k in t else f"{k[:-2]} -" for k in ("build_s", "compile_s", "run_s")
            )
            print(
                f"    {t.get('seconds', 0.0):7.3f}s  {split}  ok={t['ok']}  {t.get('reused', ''):<11} {t['change']}"
            )


def main() -> int:
    torch.set_num_threads(1)
    which = sys.argv[1:] or ["zoo", "schnetpack"]
    if "zoo" in which:
        for bug in ZOO:
            torch._dynamo.reset()
            start = time.perf_counter()
            fm = gradprobe.probe(reference_spec(bug=bug), diagnose=True, progress=False)
            show(bug, fm, time.perf_counter() - start)
    if "schnetpack" in which:
        from real_package import schnetpack_case_parts

        parts = schnetpack_case_parts()
        if parts is None:
            print("schnetpack: skipped (not installed)")
            return 0
        model, step, batch, batch2, terms = parts
        spec = gradprobe.ProbeSpec(model=model, step=step, batch=batch, second_batch=batch2, terms=terms)
        torch._dynamo.reset()
        start = time.perf_counter()
        fm = gradprobe.probe(spec, variants="eager,compile_model:aot_eager", diagnose=True, progress=False)
        show("SchNetPack eager,compile_model:aot_eager", fm, time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
