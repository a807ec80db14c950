"""graph-break-in-model: a term's value depends on parameters that its gradient does not reach,
because the code cuts the chain (``detach``, ``.data``, ``no_grad``, ``inference_mode``, ``.item()``,
NumPy, ``tolist``, an integer cast) — in one term or all, whether or not other terms still reach them.

Evidence: the lineage of each path's step (``gradprobe.evidence.lineage``), the measured statuses of
the term's own scenario in that path, and, for dependence that left torch as a Python number or
array, a finite-difference confirmation. Named op, module and line (the graph node for a replayed
trace). Parameters a note declares as intended (``notes``) turn the error into information.
"""

from __future__ import annotations

from typing import Any

from ..claims import claim
from ..flowmap import Finding, FlowMap
from ..wording import names
from .common import where
from .lineage_cuts import SPELLING as _SPELLING
from .lineage_cuts import (
    chain_words,
    classify,
    explicit,
    fd_words,
    in_reference,
    leaves_terms_dead,
    lost_words,
    place_claims,
    place_evidence,
    place_notes,
    places,
    short_site,
    status_words,
    term_names,
    unreached_by_step,
    where_seen,
)

CAUSE = "graph-break-in-model"


def detect(fm: FlowMap) -> list[Finding]:
    chosen = [p for p in places(fm) if classify(fm, p) == CAUSE]
    groups = _every_route_cut(fm, chosen)
    grouped = {id(p) for g in groups for p in g}
    findings = [_every_route_finding(fm, g) for g in groups]
    for place in chosen:
        if id(place) in grouped:
            continue
        site = place.site
        kind = str(site.get("kind"))
        terms = term_names(place)
        notes = place_notes(fm, place)
        intended = len(notes) == len(place.parameters)
        seen = where_seen(fm, place)
        others = _reached_by_others(fm, place)
        message = (
            f"{', '.join(terms)}: the value depends on {lost_words(place)} ({status_words(place)}) — the chain is "
            "cut by "
            f"{_SPELLING.get(kind, kind)} at {where(site)}"
            + (f" (graph node {site['node']})" if site.get("node") else "")
            + chain_words(place)
            + (f"; {seen}" if seen else "")
            + (f"; other terms still reach {names(others)}" if others else "")
            + (f"; {fd}" if (fd := fd_words(fm, place)) else "")
        )
        if intended:
            message += " — intended: " + "; ".join(sorted(set(notes.values())))
        bis = next(
            (b for v in place.variants if (b := fm.bisection(v)) is not None and b.get("summary")), None
        )
        verified = (bis or {}).get("fix") or {}
        if bis is not None:
            message += f"; bisect ({bis['variant']}): {bis['summary']}"
        findings.append(
            Finding(
                CAUSE,
                "info" if intended else "error",
                message,
                evidence={
                    **place_evidence(fm, place),
                    "lineage": [fm.evidence["lineage"][v].get("label") for v in place.variants],
                    "bisection": bis,
                },
                location={**site, "variants": place.variants},
                claims=(
                    *place_claims(fm, place),
                    *([claim("noted", "declared in notes", parameters=place.parameters)] if intended else []),
                ),
                fix=(
                    "intended (declared in notes): nothing to do"
                    if intended
                    else _remedy(kind, ", ".join(terms), str(site.get("op", "")))
                    + ", or, if the cut is intended, declare it in notes={parameter prefix: why}"
                    + (
                        f"; verified: {verified['variant']} matches {fm.reference}"
                        if verified.get("ok") and bis is not None and (bis.get("culprit") or {})
                        else ""
                    )
                ),
            )
        )
    return findings


def _every_route_cut(fm: FlowMap, chosen: list[Any]) -> list[list[Any]]:
    """Explicit stop-gradients of the step, on different terms, that together leave the same parameters
    trained by no term, none of them a root the others could be told apart from (a VQ-VAE's codebook
    term with its detach on the wrong side, beside the straight-through and commitment detaches): one
    problem, one finding."""
    by: dict[frozenset[str], list[Any]] = {}
    for p in chosen:
        if (
            not (explicit(p.site) and in_reference(fm, p.site))
            or place_notes(fm, p)
            or leaves_terms_dead(fm, p)
        ):
            continue
        left = frozenset(unreached_by_step(fm, p))
        if left:
            by.setdefault(left, []).append(p)
    return [g for g in by.values() if len(g) > 1 and len({tuple(p.terms) for p in g}) == len(g)]


def _every_route_finding(fm: FlowMap, group: list[Any]) -> Finding:
    group = sorted(group, key=lambda p: (str(p.site.get("file")), p.site.get("line") or 0))
    lost = [p for p in group[0].parameters if p in set(unreached_by_step(fm, group[0]))]
    widest = max(fm.scenarios, key=lambda s: len(s.terms))
    routes = "; ".join(f"{', '.join(term_names(p))} at {short_site(p.site)}" for p in group)
    first = group[0]
    return Finding(
        CAUSE,
        "error",
        f"{names(lost)}: trained by no term — the value of each term below depends on them, and each route is cut "
        f"by an explicit stop-gradient: {routes}; the first is at {where(first.site)}",
        evidence={
            "parameters": lost,
            "places": [place_evidence(fm, p) for p in group],
            "runs": [r for p in group for r in place_evidence(fm, p)["runs"]],
        },
        location={**first.site, "variants": first.variants},
        claims=(
            *(c for p in group for c in place_claims(fm, p)),
            claim(
                "statuses",
                f"in {fm.reference}, {widest.name}: no gradient or exact zero for {names(lost)}",
                variant=fm.reference,
                scenario=widest.name,
                parameters=lost,
                status=["none", "zero"],
            ),
        ),
        fix=(
            f"remove the stop-gradient on the route meant to train {names(lost)} (the others may be intended), or, "
            "if nothing is meant to train them, freeze them or declare them in notes={parameter prefix: why}"
        ),
    )


def _remedy(kind: str, terms: str, op: str = "") -> str:
    """What removes a cut of this kind, in the words of the construct the lineage recorded."""
    if kind == "non_differentiable" and op == "CheckpointFunction.apply":
        # torch.utils.checkpoint(use_reentrant=True) returns an output without gradient when none of its
        # tensor inputs requires grad, whatever the parameters inside need.
        return (
            "torch.utils.checkpoint with use_reentrant=True gives no gradient to the parameters inside when none "
            "of its tensor inputs requires grad: pass use_reentrant=False, or give it an input that requires "
            "grad (not tried)"
        )
    if kind == "autograd_grad_no_create_graph":
        return (
            f"pass create_graph=True to that torch.autograd.grad call, so {terms} can be differentiated again"
        )
    if kind in ("no_grad", "inference_mode"):
        return f"compute the values {terms} needs outside the {_SPELLING[kind].split(' under ')[1]} block"
    if kind in ("item", "float", "tolist", "numpy", "int_cast", "non_differentiable"):
        return (
            f"keep the value a tensor on the path from these parameters to {terms} (no .item()/NumPy/integer round "
            "trip, no torch.tensor() of a number)"
        )
    return f"remove the {_SPELLING.get(kind, kind)} on the path from these parameters to {terms}"


def _reached_by_others(fm: FlowMap, place) -> list[str]:  # type: ignore[no-untyped-def]
    """Cut parameters that another term still reaches (so 'all' looks fine while the term is flat)."""
    out = []
    for v in place.variants[:1]:
        for s in fm.scenarios:
            if len(s.terms) != 1 or s.terms[0] in place.terms:
                continue
            reached = fm.reached(v, s.name)
            out.extend(p for p in place.parameters if p in reached and p not in out)
    return out
