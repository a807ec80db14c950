"""Cuts read from lineage evidence: which term loses which parameters at which site, in which path.

Not a cause itself: the causes that name a cut (graph-break-in-model, makefx-detach, trace-eval-mode,
frozen-trace) share this reading. A cut is a parameter that a term's *value* depends on while the
term's *gradient* to it, as measured in that path, is none or exactly zero; it is attributed to the
cut sites in the term's history that carried that parameter. Dependence that left torch (``.item()``,
NumPy) counts only where finite differences confirmed the term moves with the parameter.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..flowmap import FlowMap
from ..wording import names

TOTAL = "__total__"
LEAVING = ("item", "float", "tolist", "numpy")


@dataclass
class Place:
    """One cut site, merged over the paths where it was seen."""

    site: dict[str, Any]
    variants: list[str] = field(default_factory=list)
    terms: list[str] = field(default_factory=list)
    parameters: list[str] = field(default_factory=list)
    statuses: dict[str, str] = field(default_factory=dict)  # parameter -> "none" | "zero" (first seen)

    @property
    def key(self) -> tuple[Any, ...]:
        s = self.site
        return (s.get("kind"), s.get("file"), s.get("line"), s.get("node"))


def cause_of(site: Mapping[str, Any]) -> str:
    """Which catalogue entry a cut site belongs to."""
    kind = site.get("kind")
    if kind == "autograd_grad_no_create_graph":
        return "trace-eval-mode" if "eval mode" in str(site.get("detail", "")) else "graph-break-in-model"
    if kind == "baked_constant":
        return "frozen-trace"
    if site.get("container") == "fx" and kind in ("detach", "data"):
        code = str(site.get("code", ""))
        explicit = ".detach(" in code or ".data" in code
        # make_fx records detach on tensors saved for backward (PyTorch #175477); a detach the user
        # wrote shows its own line. Either way it is in the graph, not in the eager Python.
        return "makefx-detach" if site.get("feeds_backward") or not explicit else "graph-break-in-model"
    return "graph-break-in-model"


def _scenario_for(fm: FlowMap, term: str) -> str | None:
    if term == TOTAL:
        widest = max(fm.scenarios, key=lambda s: len(s.terms), default=None)
        return widest.name if widest is not None else None
    return next((s.name for s in fm.scenarios if s.terms == (term,)), None)


def unreached_in(fm: FlowMap, variant: str, scenario: str) -> dict[str, str] | None:
    """Parameter -> "none"/"zero" for a run; every parameter ("none") when the run had no gradient
    path at all; None when it failed otherwise (no evidence of what it reaches)."""
    try:
        run = fm.run(variant, scenario)
    except KeyError:
        return None
    if run.error is not None:
        return dict.fromkeys(fm.trainable, "none") if run.error.type == "NoGradPath" else None
    return {p: c.status for p, c in fm.cells_of(variant, scenario).items() if c.status in ("none", "zero")}


def _confirmed(fm: FlowMap, variant: str) -> dict[str, set[str]]:
    """Leaving site id -> terms that finite differences showed to move with its parameters."""
    out: dict[str, set[str]] = {}
    for c in (fm.evidence.get("confirmations") or {}).get(variant) or []:
        if "key" in c:
            out[str(c["key"])] = set(c.get("confirmed") or ())
    return out


def places(fm: FlowMap) -> list[Place]:
    """Every cut site that costs some term a parameter, in some path, merged by place."""
    merged: dict[tuple[Any, ...], Place] = {}
    for variant, lin in (fm.evidence.get("lineage") or {}).items():
        if lin.get("error") or variant not in fm.variant_names:
            continue
        sites = {s["id"]: s for s in lin.get("sites") or ()}
        confirmed = _confirmed(fm, variant)
        for term, tl in (lin.get("terms") or {}).items():
            scenario = _scenario_for(fm, term)
            missing = unreached_in(fm, variant, scenario) if scenario is not None else None
            if not missing:
                continue
            carried = set(tl.get("depends_on") or ()) - set(tl.get("cut") or ())
            cut = [p for p in tl.get("cut") or () if p in missing]
            found: list[tuple[dict[str, Any], list[str]]] = []
            for sid in tl.get("sites") or ():
                site = sites.get(sid)
                if site is None or site.get("kind") in LEAVING:
                    continue
                hit = [p for p in cut if p in (site.get("parameters") or ())]
                if hit:
                    found.append((site, hit))
            # Dependence that left torch: blamed only where finite differences confirmed it.
            for site in sites.values():
                if site.get("kind") in LEAVING and term in confirmed.get(str(site["id"]), set()):
                    hit = [p for p in site.get("parameters") or () if p in missing and p not in carried]
                    if hit:
                        found.append((site, hit))
            for site, hit in found:
                _add(merged, site, variant, term, hit, missing)
    return list(merged.values())


def _add(
    merged: dict[tuple[Any, ...], Place],
    site: dict[str, Any],
    variant: str,
    term: str,
    hit: Iterable[str],
    missing: Mapping[str, str],
) -> None:
    key = (site.get("kind"), site.get("file"), site.get("line"), site.get("node"))
    place = merged.setdefault(key, Place(site))
    if variant not in place.variants:
        place.variants.append(variant)
    if term not in place.terms:
        place.terms.append(term)
    for p in hit:
        if p not in place.parameters:
            place.parameters.append(p)
            place.statuses[p] = missing[p]


def explained_runs(fm: FlowMap, place: Place) -> list[list[str]]:
    """(variant, scenario) runs a cut explains: every scenario holding a cut term, in each path."""
    terms = set(place.terms)
    return [
        [v, s.name] for v in place.variants for s in fm.scenarios if terms & set(s.terms) or TOTAL in terms
    ]


def status_words(place: Place) -> str:
    """'no gradient: a, b; exact zero: c' for the cut parameters."""
    none = [p for p, st in place.statuses.items() if st == "none"]
    zero = [p for p, st in place.statuses.items() if st == "zero"]
    parts = []
    if none:
        parts.append(f"no gradient: {names(none)}")
    if zero:
        parts.append(f"exact zero: {names(zero)}")
    return "; ".join(parts)


def where_seen(fm: FlowMap, place: Place) -> str:
    """'every path' when the reference has it too, else the paths."""
    if fm.reference in place.variants:
        return (
            "in the reference path (and every path that runs the same code)" if len(fm.variants) > 1 else ""
        )
    return "only in " + ", ".join(place.variants)
