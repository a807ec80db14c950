"""What the necessary work of an eager probe and its state guarantee cost on section 6's small models.

    python benchmarks/bound_small.py            # 300 interleaved rounds per model
    python benchmarks/bound_small.py --reps 50
    python benchmarks/bound_small.py --phases   # also the guarantee level by level
    python benchmarks/bound_small.py --warm     # each call right after one of itself, no gc.collect()

``minimal`` below is a hand-written probe of one model: the least a probe that leaves the model as it
found it must do. It saves the buffers (a copy), the RNG state, the modules' modes and the ``.grad``
objects; runs one forward and one ``autograd.grad`` per term on the retained graph; sums the terms'
gradients for the scenario of all of them; takes every L1 norm with one ``_foreach_norm``, copies them
and the term values to the host once; and puts the state back. It does not check the spec, save
parameters' values, module attributes, hooks, process-wide settings, Python's or NumPy's RNG, nor build
a flow map or findings: what gradprobe does besides that work is its bookkeeping.

``guarded`` runs the same work inside gradprobe's own walk of the model and its whole state guarantee
(``contained`` and ``preserved``, as ``probe`` runs them): the gap between it and the floor is what
keeping the user's state costs, whatever the rest of the probe costs.

``listed`` runs it inside the same walk and ``contained``, keeping only what the developers' guide
lists by name (values of parameters, ``.grad`` and buffers, ``.grad`` objects, ``requires_grad``, modes,
RNG streams, config), each the cheapest generic way: the gap between it and ``guarded`` is what the
rest of gradprobe's guarantee (module attributes, nn.Module's containers and hooks, the other settings,
mode stacks, global hooks) costs.

Printed per model, minima of interleaved rounds (the naive loop, the floor, ``minimal``, ``listed``,
``guarded`` and ``gradprobe.probe``, ``gc.collect()`` before each call, as section 6 measures): each
against the floor. The gap between ``minimal`` and the probe is the bookkeeping's cost
(docs/benchmarks.md, "Seventh session on issue 20"); between ``guarded`` and the floor, the state
guarantee's ("Eighth session"); between ``listed`` and ``guarded``, the part of it beyond the guide's
list ("Ninth session").
"""

from __future__ import annotations

import argparse
import ctypes
import operator
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_probe as bp
from baselines import floor_eager, naive_eager
from timing import best, interleaved

import gradprobe
from gradprobe import state
from gradprobe.state import contained, preserved
from gradprobe.walk import walk


def _work(model: torch.nn.Module, step: Any, batch: Any, params: list[torch.nn.Parameter]) -> list[float]:
    """The measurement itself: one forward, one ``autograd.grad`` per term, the sum for all of them,
    every L1 norm in one ``_foreach_norm`` and one copy to the host."""
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
    return torch.stack([*norms, *(v.detach().float() for v in out.values())]).tolist()


def minimal(model: torch.nn.Module, step: Any, batch: Any) -> list[float]:
    """``_work`` with the least state kept: buffers, torch's CPU RNG, modes and ``.grad`` objects."""
    params = [p for p in model.parameters() if p.requires_grad]
    modules = list(model.modules())
    modes = [m.training for m in modules]
    buffers = list(model.buffers())
    saved = [b.clone() for b in buffers]
    rng = torch.get_rng_state()
    grads_before = [p.grad for p in params]
    host = _work(model, step, batch, params)
    for b, s in zip(buffers, saved, strict=True):
        b.copy_(s)
    torch.set_rng_state(rng)
    for m, training in zip(modules, modes, strict=True):
        m.training = training
    for p, g in zip(params, grads_before, strict=True):
        p.grad = g
    return host


_TRAINING = operator.attrgetter("training")
_DATA, _GRAD, _REQUIRES_GRAD, _NBYTES = state._DATA, state._GRAD, state._REQUIRES_GRAD, state._NBYTES


def listed(model: torch.nn.Module, step: Any, batch: Any) -> list[float]:
    """``_work`` inside gradprobe's walk and ``contained``, keeping only what the developers' guide
    lists ("parameters, ``.grad``, ``requires_grad``, modes, buffers, RNG, torch/dynamo config are
    restored"), each in the cheapest generic way: the values of parameters, ``.grad`` and buffers as
    the bytes of their memory (plain contiguous CPU tensors, as on these models; else ``_Saved``),
    compared and written back byte for byte where they differ, with a ``.data`` alias each so that a
    replaced storage is put back and never written after it is freed; the ``.grad`` objects,
    ``requires_grad`` flags, module modes and grad mode; the RNG streams (gradprobe's own reads: torch,
    Python, NumPy). Not kept: module attribute bindings, nn.Module's containers and hook dicts, tensor
    hooks, the other process-wide settings, mode stacks and global hooks, which gradprobe's guarantee
    also keeps. The gap between it and ``guarded`` is what those cost."""

    def body() -> list[float]:
        tree = walk(model)
        every = [p for _, p in tree.parameters]
        params = [p for p in every if p.requires_grad]
        modules = tree.modules
        grads = list(map(_GRAD, every))
        flags = list(map(_REQUIRES_GRAD, every))
        modes = list(map(_TRAINING, modules))
        grad_mode = torch.is_grad_enabled()
        buffers = [b for m in modules for b in m._buffers.values() if b is not None]
        tensors = [*every, *(g for g in grads if g is not None), *buffers]
        aliases = list(map(_DATA, tensors))
        plain = all(type(a) is torch.Tensor and a.is_cpu and a.is_contiguous() for a in aliases)
        if plain:
            pointers = list(map(torch.Tensor.data_ptr, aliases))
            sizes = list(map(_NBYTES, aliases))
            host = list(map(ctypes.string_at, pointers, sizes))
        else:
            saved = state._Saved(tensors)
        rng = state._snapshot_rng()
        try:
            return _work(model, step, batch, params)
        finally:
            state._restore_rng(rng)
            torch.set_grad_enabled(grad_mode)
            if plain:
                for t, alias in zip(tensors, aliases, strict=True):
                    if not t.is_set_to(alias) or t.dtype != alias.dtype:
                        t.data = alias  # back on its own storage: the bytes below go there
                now = list(map(ctypes.string_at, pointers, sizes))
                if now != host:
                    for pointer, before, current in zip(pointers, host, now, strict=True):
                        if current != before:
                            ctypes.memmove(pointer, before, len(before))
            else:
                saved.restore()
            if list(map(_TRAINING, modules)) != modes:
                for m, training in zip(modules, modes, strict=True):
                    m.training = training
            if list(map(_REQUIRES_GRAD, every)) != flags or not all(
                map(operator.is_, map(_GRAD, every), grads)
            ):
                for p, flag, grad in zip(every, flags, grads, strict=True):
                    p.requires_grad_(flag)
                    p.grad = grad

    with torch.inference_mode(False):
        return contained(body)


# What guarded() runs around the work, cumulatively (``--phases`` times each level in the same rounds).
LEVELS = ("walk", "context copy", "model state", "process-wide state")


def guarded(model: torch.nn.Module, step: Any, batch: Any, upto: str = LEVELS[-1]) -> list[float]:
    """``_work`` inside gradprobe's own walk of the model and its whole state guarantee, as
    ``run_probe`` runs them: out of inference mode, in a copy of the context (``contained``), the
    model's state (values, attributes, hooks, flags, ``.grad``) and the process-wide state (settings,
    mode stacks, RNG streams) saved and put back (``preserved``). What ``probe`` costs beyond this is
    its measurement's bookkeeping, the spec checks, the flow map and the findings. ``upto``: only the
    levels of ``LEVELS`` up to this one (the last, the default, is ``preserved`` itself)."""
    level = LEVELS.index(upto)

    def body() -> list[float]:
        tree = walk(model)
        every = [p for _, p in tree.parameters]  # what the guarantee saves: trainable or not
        params = [p for p in every if p.requires_grad]
        if level == len(LEVELS) - 1:
            with preserved(model, every, tree.modules, contained=True):
                return _work(model, step, batch, params)
        if level < LEVELS.index("model state"):
            return _work(model, step, batch, params)
        saved = state._snapshot_model(model, every, tree.modules)
        try:
            return _work(model, step, batch, params)
        finally:
            state._restore_model(saved)

    with torch.inference_mode(False):
        return body() if level == 0 else contained(body)


def timed(case: bp.Case, reps: int, levels: bool = False, warm: bool = False) -> dict[str, float]:
    """Minima of interleaved rounds of the contenders on one case (seconds); ``levels``: also
    ``guarded`` up to each of its levels but the last; ``warm``: see ``timing.interleaved``."""
    model, step, batch, spec = case.model, case.step, case.batch, case.spec
    fns = {
        "naive": lambda: naive_eager(model, step, batch, case.terms, case.scenarios),
        "floor": lambda: floor_eager(model, step, batch, case.scenarios),
        "minimal": lambda: minimal(model, step, batch),
        "listed": lambda: listed(model, step, batch),
        "guarded": lambda: guarded(model, step, batch),
        "probe": lambda: gradprobe.probe(spec),
    }
    if levels:
        for name in LEVELS[:-1]:
            fns[name] = lambda name=name: guarded(model, step, batch, name)
    for fn in fns.values():  # warm-up, untimed
        fn()
    return best(interleaved(fns, reps, before=lambda: model.zero_grad(set_to_none=True), warm=warm))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=300, help="interleaved rounds per model (default 300)")
    parser.add_argument(
        "--phases",
        action="store_true",
        help="also time guarded() up to each of its levels (walk, context copy, model state) in the same rounds",
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="time each call right after an untimed call of the same one, no gc.collect() (section 6 runs cold)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    how = "warm: each after an untimed call of itself" if args.warm else "gc.collect() before each"
    print(f"gradprobe from {Path(gradprobe.__file__).parent}, {args.reps} interleaved rounds, minima ({how})")
    contenders = ("minimal", "listed", "guarded", "probe")
    print(
        f"{'model':<34}{'naive ms':>10}{'floor ms':>10}"
        + "".join(f"{c + ' ms':>12}" for c in contenders)
        + "".join(f"{c + '/floor':>15}" for c in contenders)
    )
    rows = []
    for make in (bp.small_case, bp.mlp_case, bp.encoder_case):
        case = make()
        b = timed(case, args.reps, levels=args.phases, warm=args.warm)
        rows.append((case.name, b))
        ms = f"{b['naive'] * 1e3:>10.3f}{b['floor'] * 1e3:>10.3f}" + "".join(
            f"{b[c] * 1e3:>12.3f}" for c in contenders
        )
        ratios = "".join(f"{b[c] / b['floor']:>14.2f}x" for c in contenders)
        print(f"{case.name:<34}{ms}{ratios}")
    if args.phases:
        print(
            "\nguarded() up to each level, against the floor (same rounds; each level adds to the one before)"
        )
        print(f"{'model':<34}" + "".join(f"{n:>20}" for n in LEVELS))
        for name, b in rows:
            print(f"{name:<34}" + "".join(f"{b[n if n != LEVELS[-1] else 'guarded'] / b['floor']:>19.2f}x"
                                          for n in LEVELS))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
