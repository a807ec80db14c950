"""rank-divergence: replicated parameters hold different values on different ranks: the ranks are out
of sync, and DDP trains N different models.

Evidence: ``checks["distributed"]["divergence"]`` of a map merged over ranks (a float64 checksum per
parameter compared with rank 0's). A map of one process has none: nothing is found."""

from __future__ import annotations

from collections.abc import Mapping

from ..claims import claim
from ..flowmap import Finding, FlowMap
from ..wording import names, rank_list

CAUSE = "rank-divergence"


def detect(fm: FlowMap) -> list[Finding]:
    d = fm.checks.get("distributed")
    if not isinstance(d, Mapping):
        return []  # not a merged map of ranks (distributed.merge_maps)
    div = d.get("divergence") or {}
    off = div.get("parameters") or {}
    if not off:
        return []
    params = list(off)
    bad_ranks = sorted({r for e in off.values() for r in e.get("ranks", ())})
    worst = max(float(e.get("max_rel_diff", 0.0)) for e in off.values())
    return [
        Finding(
            CAUSE,
            "error",
            f"{len(params)} replicated parameter(s) hold different values on rank(s) {rank_list(bad_ranks)} "
            f"than on rank 0: {names(params)} (relative checksum difference up to {worst:.3g}, "
            f"tolerance {div.get('rtol')}): the ranks are out of sync",
            evidence={"parameters": params, "ranks": bad_ranks, "divergence": dict(off)},
            location={"modules": sorted({p.rpartition(".")[0] or p for p in params})},
            claims=(
                claim(
                    "diverged",
                    f"{names(params)} differ from rank 0's on rank(s) {rank_list(bad_ranks)} (relative "
                    f"checksum difference up to {worst:.3g})",
                    parameters=params,
                    ranks=bad_ranks,
                    at_least=worst,
                ),
            ),
            fix="start every rank from the same values: build the model with the same seed, or wrap it in "
            "DistributedDataParallel before training (it broadcasts rank 0's parameters and buffers at "
            "construction); keep every update identical on every rank (no rank-dependent optimizer "
            "steps, no parameter changes outside the DDP-reduced gradient, the same gradient clipping "
            "on all ranks). Different values on different ranks make DDP train N different models",
        )
    ]
