"""ddp-globally-unused: a parameter gets no non-zero gradient on any rank in any scenario (it takes the
place of unused-parameter for those parameters: a plain DDP wrapper fails on the ones with no path).

Evidence: ``checks["distributed"]`` of a map merged over ranks (``ranks``, ``no_path``, the wrapper's
settings) and the spec's notes. A map of one process has none: nothing is found."""

from __future__ import annotations

from ..claims import claim
from ..declarations import note_for
from ..flowmap import Finding, FlowMap
from ..wording import names
from .ddp_locally_unused import DDP_ERROR, rank_reach

CAUSE = "ddp-globally-unused"


def detect(fm: FlowMap) -> list[Finding]:
    reach = rank_reach(fm)
    if reach is None:
        return []  # not a merged map of ranks (distributed.merge_maps)
    d, world, wrapper, ref, ranks, no_path = reach
    if not ranks or {t for s in fm.scenarios if s.name in ranks for t in s.terms} != set(fm.terms):
        return []  # some term was measured on no rank: nothing can be called unused
    unused = [p for p in fm.trainable if all(not ranks[s].get(p) for s in ranks)]
    if not unused:
        return []
    notes = {p: n for p in unused if (n := note_for(p, fm.notes)) is not None}
    no_path_all = [p for p in unused if all(len((no_path.get(s) or {}).get(p, [])) == world for s in ranks)]
    message = f"{len(unused)} parameter(s) get no non-zero gradient on any rank: {names(unused)}"
    claims = [
        claim(
            "unreached_on_every_rank", f"no rank reaches {names(unused)} in any scenario", parameters=unused
        )
    ]
    if no_path_all:
        claims.append(claim("unreached_on_every_rank", f"no rank has an autograd path to {names(no_path_all)}",
                            parameters=no_path_all, no_path=True))  # fmt: skip
    if notes:
        claims.append(claim("noted", "declared in notes", parameters=list(notes)))
    if notes:
        message += " — " + "; ".join(sorted(set(notes.values())))
    if no_path_all and wrapper != "fsdp2":
        message += (
            f". {len(no_path_all)} have no autograd path on any rank: DDP without "
            f"find_unused_parameters=True fails on them with {DDP_ERROR!r}"
        )
    if wrapper == "ddp" and d.get("find_unused_parameters"):
        message += " (find_unused_parameters=True is set)"
        claims.append(claim("wrapper", "ddp with find_unused_parameters=True", wrapper="ddp",
                            setting="find_unused_parameters", value=d.get("find_unused_parameters")))  # fmt: skip
    fix = "freeze them (requires_grad_(False)) before wrapping the model, or remove them; " + (
        "FSDP2 otherwise needs set_reduce_scatter_unused_params(True)"
        if wrapper == "fsdp2"
        else "otherwise DDP needs find_unused_parameters=True (each iteration then "
        "traverses the graph to mark them ready)"
    )
    return [
        Finding(
            CAUSE,
            "info" if len(notes) == len(unused) else "warning",
            message,
            evidence={
                "variant": ref,
                "parameters": unused,
                "notes": notes,
                "no_path": no_path_all,
            },
            location={"modules": sorted({p.rpartition(".")[0] or p for p in unused})},
            claims=tuple(claims),
            fix=fix,
        )
    ]
