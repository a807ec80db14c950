"""The per-rank summary of a map merged over ranks (``gradprobe run --nproc N``): the parameters each
rank reaches, read from ``checks["distributed"]``."""

from __future__ import annotations

from collections.abc import Mapping

from ..flowmap import FlowMap
from ..wording import names, rank_list


def render_ranks(fm: FlowMap) -> str:
    """A short per-rank table from ``checks["distributed"]``: parameters reached on each rank."""
    d = fm.checks.get("distributed")
    if not isinstance(d, Mapping):
        return ""
    world = int(d.get("world_size", 1))
    per = d.get("reached_per_rank") or {}
    total = len(fm.trainable)
    head = (
        f"distributed: {world} ranks, backend {d.get('backend')}, wrapper {d.get('wrapper')}"
        + (
            f" (find_unused_parameters={d.get('find_unused_parameters')})"
            if d.get("wrapper") == "ddp"
            else ""
        )
        + f"; parameters reached per rank ({d.get('reference')}), merged = reduced gradient:"
    )
    width = max([len(s) for s in per] + [8]) + 2
    lines = [head, " " * width + "".join(f"rank {r:<5}" for r in range(world)) + "merged"]
    for s, counts in per.items():
        merged = len(fm.reached(str(d.get("reference")), s))
        lines.append(
            f"{s + ':':<{width}}" + "".join(f"{f'{c}/{total}':<10}" for c in counts) + f"{merged}/{total}"
        )
    for s, rs in (d.get("failed") or {}).items():
        lines.append(f"{s + ':':<{width}}failed on rank(s) {rank_list(rs)}")
    off = (d.get("divergence") or {}).get("parameters") or {}
    if off:
        lines.append(f"parameter values differ between ranks: {names(list(off))}")
    return "\n".join(lines) + "\n"
