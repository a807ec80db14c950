"""One memory measurement in a fresh process: ``python memory_worker.py KIND BRANCHES WIDTH``.

KIND is ``step`` (a plain training step: zero_grad, forward, total of all terms, backward, SGD step)
or ``probe`` (``gradprobe.probe`` in eager, the defaults: each term alone plus all). The model is a
``WideModel(BRANCHES, WIDTH)`` without big layers (2 x BRANCHES parameter tensors).

Measured: the resident set size (RSS) the run adds on top of the process after setup. After the
model, the batch and a small warm-up exist, the kernel's peak-RSS mark is reset
(``/proc/self/clear_refs`` = 5, Linux >= 4.0), then the run, then the peak (``VmHWM``) is read; the
extra is ``VmHWM - VmRSS before the run``. RSS sees every CPU allocation of torch (``tracemalloc``
sees none of them); a fresh process per measurement keeps one run's freed memory from hiding the
next one's. Prints one JSON line.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from wide_model import TERMS, make_wide, size_of, wide_step

import gradprobe


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def plain_step(model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad(set_to_none=True)
    values = wide_step(model, batch)  # type: ignore[arg-type]
    total = values[TERMS[0]]
    for t in TERMS[1:]:
        total = total + values[t]
    total.backward()
    optimizer.step()


def main() -> None:
    kind, branches, width = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    # Warm-up (same for both kinds): lazy initialisation of autograd, optimizers and the probe.
    tiny, tiny_batch = make_wide(4, 2)
    plain_step(tiny, tiny_batch, torch.optim.SGD(tiny.parameters(), lr=1e-3))
    gradprobe.probe(tiny, wide_step, tiny_batch, terms=list(TERMS))

    model, batch = make_wide(branches, width)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    spec = gradprobe.ProbeSpec(model=model, step=wide_step, batch=batch, terms=list(TERMS))
    del tiny, tiny_batch
    gc.collect()
    _reset_peak()
    before = _status_kb("VmRSS")
    map_chars = None
    if kind == "step":
        plain_step(model, batch, optimizer)
    elif kind == "probe":
        fm = gradprobe.probe(spec)
        map_chars = len(fm.to_json())
    else:
        raise SystemExit(f"unknown kind {kind!r}: step or probe")
    peak = _status_kb("VmHWM")
    tensors, scalars = size_of(model)
    print(
        json.dumps(
            {
                "kind": kind,
                "branches": branches,
                "width": width,
                "tensors": tensors,
                "scalars": scalars,
                "param_mb": scalars * 4 / 2**20,
                "before_mb": before / 1024,
                "extra_mb": (peak - before) / 1024,
                "map_chars": map_chars,
            }
        )
    )


if __name__ == "__main__":
    main()
