"""What the necessary work of an eager probe costs on section 6's small models: a lower bound.

    python benchmarks/bound_small.py            # 300 interleaved rounds per model
    python benchmarks/bound_small.py --reps 50

``minimal`` below is a hand-written probe of one model: the least a probe that leaves the model as it
found it must do. It saves the buffers (a copy), the RNG state, the modules' modes and the ``.grad``
objects; runs one forward and one ``autograd.grad`` per term on the retained graph; sums the terms'
gradients for the scenario of all of them; takes every L1 norm with one ``_foreach_norm``, copies them
and the term values to the host once; and puts the state back. It does not check the spec, save
parameters' values, module attributes, hooks, process-wide settings, Python's or NumPy's RNG, nor build
a flow map or findings: what gradprobe does besides that work is its bookkeeping.

Printed per model, minima of interleaved rounds (the naive loop, the floor, ``minimal`` and
``gradprobe.probe``, ``gc.collect()`` before each call, as section 6 measures): each against the floor.
The measured gap between ``minimal`` and the probe is the bookkeeping's cost (docs/benchmarks.md,
"Seventh session on issue 20").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_probe as bp
from baselines import floor_eager, naive_eager
from timing import best, interleaved

import gradprobe


def minimal(model: torch.nn.Module, step: Any, batch: Any) -> list[float]:
    params = [p for p in model.parameters() if p.requires_grad]
    modules = list(model.modules())
    modes = [m.training for m in modules]
    buffers = list(model.buffers())
    saved = [b.clone() for b in buffers]
    rng = torch.get_rng_state()
    grads_before = [p.grad for p in params]
    with torch.enable_grad():
        out = step(model, batch)
        names = list(out)
        per_term = [
            torch.autograd.grad(out[t], params, retain_graph=k < len(names) - 1, allow_unused=True)
            for k, t in enumerate(names)
        ]
    total = [
        None if all(g[i] is None for g in per_term) else sum(g[i] for g in per_term if g[i] is not None)
        for i in range(len(params))
    ]
    flat = [g for gs in (*per_term, total) for g in gs if g is not None]
    norms = torch._foreach_norm(flat, 1, dtype=torch.float32)
    host = torch.stack([*norms, *(v.detach().float() for v in out.values())]).tolist()
    for b, s in zip(buffers, saved, strict=True):
        b.copy_(s)
    torch.set_rng_state(rng)
    for m, training in zip(modules, modes, strict=True):
        m.training = training
    for p, g in zip(params, grads_before, strict=True):
        p.grad = g
    return host


def timed(case: bp.Case, reps: int) -> dict[str, float]:
    """Minima of interleaved rounds of the four contenders on one case (seconds)."""
    model, step, batch, spec = case.model, case.step, case.batch, case.spec
    fns = {
        "naive": lambda: naive_eager(model, step, batch, case.terms, case.scenarios),
        "floor": lambda: floor_eager(model, step, batch, case.scenarios),
        "minimal": lambda: minimal(model, step, batch),
        "probe": lambda: gradprobe.probe(spec),
    }
    for fn in fns.values():  # warm-up, untimed
        fn()
    return best(interleaved(fns, reps, before=lambda: model.zero_grad(set_to_none=True)))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=300, help="interleaved rounds per model (default 300)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"gradprobe from {Path(gradprobe.__file__).parent}, {args.reps} interleaved rounds, minima")
    print(
        f"{'model':<34}{'naive ms':>10}{'floor ms':>10}{'minimal ms':>12}{'probe ms':>10}"
        f"{'minimal/floor':>15}{'probe/floor':>13}"
    )
    for make in (bp.small_case, bp.mlp_case, bp.encoder_case):
        case = make()
        b = timed(case, args.reps)
        print(
            f"{case.name:<34}{b['naive'] * 1e3:>10.3f}{b['floor'] * 1e3:>10.3f}{b['minimal'] * 1e3:>12.3f}"
            f"{b['probe'] * 1e3:>10.3f}{b['minimal'] / b['floor']:>14.2f}x{b['probe'] / b['floor']:>12.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
