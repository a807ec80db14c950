"""ddp-locally-unused: a parameter gets a gradient on some ranks and not on others, so DDP's reducer
(or FSDP2's reduce-scatter) waits for a gradient some ranks never produce.

Evidence: ``checks["distributed"]`` of a map merged over ranks (``distributed.merge_maps``): per
scenario, the ranks reaching each parameter (``ranks``) and those with no autograd path to it
(``no_path``), and the wrapper's settings. A map of one process has none: nothing is found."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from ..claims import claim
from ..flowmap import Finding, FlowMap
from ..wording import names, rank_list

CAUSE = "ddp-locally-unused"
DDP_ERROR = "Expected to have finished reduction in the prior iteration before starting a new one"


class RankReach(NamedTuple):
    """What the ddp detectors read of a map merged over ranks (``checks["distributed"]``)."""

    check: Mapping[str, Any]  # the whole record: the wrapper's settings
    world: int
    wrapper: str
    reference: str
    ranks: Mapping[str, Mapping[str, list[int]]]  # scenario -> parameter -> ranks reaching it
    no_path: Mapping[str, Mapping[str, list[int]]]  # scenario -> parameter -> ranks with no autograd path


def rank_reach(fm: FlowMap) -> RankReach | None:
    """The per-rank reach of a merged map; None for a map of one process."""
    d = fm.checks.get("distributed")
    if not isinstance(d, Mapping):
        return None
    return RankReach(
        d,
        int(d.get("world_size", 1)),
        str(d.get("wrapper", "none")),
        str(d.get("reference", fm.reference)),
        d.get("ranks") or {},
        d.get("no_path") or {},
    )


def detect(fm: FlowMap) -> list[Finding]:
    reach = rank_reach(fm)
    if reach is None:
        return []  # not a merged map of ranks (distributed.merge_maps)
    d, world, wrapper, ref, ranks, no_path = reach
    partial: dict[str, dict[str, dict[str, list[int]]]] = {}
    for s, per_param in ranks.items():
        for p, rs in per_param.items():
            if 0 < len(rs) < world:
                missing = [r for r in range(world) if r not in rs]
                partial.setdefault(p, {})[s] = {
                    "reached_on": list(rs),
                    "not_reached_on": missing,
                    "no_path_on": [r for r in (no_path.get(s) or {}).get(p, []) if r in missing],
                }
    if not partial:
        return []
    params = list(partial)
    # The training loss is the scenario with every term; without one, any scenario may be trained.
    full = [sc.name for sc in fm.scenarios if set(sc.terms) == set(fm.terms)] or list(ranks)
    gaps = sorted({s for per in partial.values() for s, e in per.items() if e["no_path_on"]})
    in_training = [s for s in gaps if s in full]
    handled = (wrapper == "ddp" and d.get("find_unused_parameters")) or (
        wrapper == "fsdp2" and d.get("reduce_scatter_unused_params")
    )
    severity = "info" if handled or not gaps else "error" if in_training else "warning"
    p0 = next((p for p in params if any(e["no_path_on"] for e in partial[p].values())), params[0])
    s0 = next((s for s in (*in_training, *gaps) if s in partial[p0]), next(iter(partial[p0])))
    e0 = partial[p0][s0]
    example = (
        f"{p0} in {s0!r}: reached on rank(s) {rank_list(e0['reached_on'])}, "
        f"not on rank(s) {rank_list(e0['not_reached_on'])}"
    )
    scenarios = [s for s in fm.scenario_names if any(s in per for per in partial.values())]
    claims = [
        claim("rank_reach", f"{p} in {s!r}: reached on rank(s) {rank_list(e['reached_on'])}, not on "
              f"{rank_list(e['not_reached_on'])}" + (f" (no autograd path on {rank_list(e['no_path_on'])})"
                                                     if e["no_path_on"] else ""),
              scenario=s, parameter=p, reached_on=e["reached_on"], no_path_on=e["no_path_on"])
        for p, per in partial.items() for s, e in per.items()
    ]  # fmt: skip
    if handled:
        setting = "find_unused_parameters" if wrapper == "ddp" else "reduce_scatter_unused_params"
        claims.append(claim("wrapper", f"{wrapper} with {setting}=True", wrapper=wrapper, setting=setting,
                            value=d.get(setting)))  # fmt: skip
    message = (
        f"{len(params)} parameter(s) get a gradient on some ranks but not on others: {names(params)} "
        f"({example}; scenarios: {', '.join(scenarios)})"
    )
    consequence = (
        "FSDP2's reduce-scatters do not match across ranks (a deadlock, or a size mismatch error)"
        if wrapper == "fsdp2"
        else f"DDP without find_unused_parameters=True fails with {DDP_ERROR!r}"
    )
    if gaps and handled:
        message += (
            " — handled by find_unused_parameters=True"
            if wrapper == "ddp"
            else " — handled by reduce_scatter_unused_params"
        )
    elif in_training:
        message += (
            f". Ranks without an autograd path to them never mark them ready for reduction, so {consequence}"
        )
    elif gaps:
        message += (
            f". Some ranks have no autograd path to them in {', '.join(repr(s) for s in gaps)} only: "
            f"when training on those terms alone, {consequence}; the loss with every term reaches "
            "them on every rank"
        )
    else:
        message += (
            ". The ranks that do not reach them still have a path (exact zero gradient), so DDP's "
            "hooks fire; only some ranks' data trains them"
        )
    return [
        Finding(
            CAUSE,
            severity,
            message,
            evidence={
                "variant": ref,
                "parameters": params,
                "ranks": partial,
                "world_size": world,
                "wrapper": wrapper,
                "find_unused_parameters": d.get("find_unused_parameters"),
            },
            location={"modules": sorted({p.rpartition(".")[0] or p for p in params})},
            claims=tuple(claims),
            fix=_fix_locally_unused(wrapper),
            references=("https://pytorch.org/docs/stable/notes/ddp.html",),
        )
    ]


def _fix_locally_unused(wrapper: str) -> str:
    """The fix for DDP, or for FSDP2 (``wrapper == "fsdp2"``)."""
    if wrapper == "fsdp2":
        return (
            "FSDP2: call model.set_reduce_scatter_unused_params(True) so ranks without a gradient "
            "reduce-scatter zeros (otherwise the reduce-scatters do not match across ranks), and do not "
            "give a module that some ranks skip its own fully_shard (its all-gather would run only on "
            "the ranks that call it): shard it with its parent. Or make every rank's batch use every "
            "branch"
        )
    return (
        "wrap with DistributedDataParallel(model, find_unused_parameters=True) (one extra traversal "
        "of the autograd graph per iteration), or make every rank's batch use every branch (a sampler "
        "that puts every atom type / task on every rank), or add a zero-weighted term that touches the "
        "branch on every rank (loss + 0 * sum(p.sum() for p in branch.parameters())) so its gradient "
        "is an exact zero instead of missing. static_graph=True does not help: it assumes the same "
        "parameters are used in every iteration, and a data-dependent branch changes that from batch "
        "to batch"
    )
