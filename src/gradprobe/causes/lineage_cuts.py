"""Cuts read from lineage evidence: which term loses which parameters at which site, in which path.

Not a cause itself: the causes that name a cut (graph-break-in-model, stop-gradient, gradient-mismatch,
makefx-detach, trace-eval-mode, frozen-trace) share this reading. A cut is a parameter that a term's
*value* depends on while the term's *gradient* to it, as measured in that path, is none or exactly zero
— or is there but off its finite differences (the ``gradients`` check: a cut on one of two routes
leaves the parameter reached with a wrong value). It is attributed to the cut sites in the term's
history that carried that parameter; where one such site lies in another's history (a chain of cuts),
the first is the root and the later ones its consequences. Dependence that left torch (``.item()``,
NumPy) counts only where finite differences confirmed the term moves with the parameter.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..declarations import note_for
from ..flowmap import FlowMap
from ..wording import names

TOTAL = "__total__"
LEAVING = ("item", "float", "tolist", "numpy")
FUNCTION = "custom_function"
WRONG = "wrong"  # a parameter's status in a place: reached, but with a gradient off its finite differences
# Constructs a user writes to stop a gradient on purpose (a GAN critic on fake.detach(), a target
# computed under no_grad): a warning when the step still trains those parameters another way.
EXPLICIT = ("detach", "no_grad", "inference_mode")


@dataclass
class Place:
    """One cut site, merged over the paths where it was seen."""

    site: dict[str, Any]
    variants: list[str] = field(default_factory=list)
    terms: list[str] = field(default_factory=list)
    parameters: list[str] = field(default_factory=list)
    statuses: dict[str, str] = field(default_factory=dict)  # parameter -> "none" | "zero" | "wrong"
    later: list[dict[str, Any]] = field(default_factory=list)  # cut sites after it in a chain
    # What each (path, term) showed at this place: the parameters cut, and the site as that path recorded it.
    hits: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    sites: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def key(self) -> tuple[Any, ...]:
        s = self.site
        return (s.get("kind"), s.get("file"), s.get("line"), s.get("node"))


def cause_of(site: Mapping[str, Any]) -> str:
    """Which catalogue entry a cut site belongs to (``classify`` refines graph-break-in-model by what
    was measured)."""
    kind = site.get("kind")
    if kind == FUNCTION:
        return "gradient-mismatch"
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


def explicit(site: Mapping[str, Any]) -> bool:
    """A stop-gradient the user wrote as such: ``.detach()`` in the step's own code, a ``no_grad`` /
    ``inference_mode`` block (not ``.data``, a NumPy or ``.item()`` round trip, a cast)."""
    kind = site.get("kind")
    return kind in EXPLICIT and (kind != "detach" or ".detach" in str(site.get("code", "")))


def in_reference(fm: FlowMap, site: Mapping[str, Any]) -> bool:
    """The reference path's own lineage has a cut of the same kind at the same line of the user's code."""
    ref = (fm.evidence.get("lineage") or {}).get(fm.reference) or {}
    return any(
        s.get("kind") == site.get("kind")
        and s.get("file") == site.get("file")
        and s.get("line") == site.get("line")
        for s in ref.get("sites") or ()
    )


def unreached_by_step(fm: FlowMap, place: Place) -> list[str]:
    """The place's parameters that no scenario of some of its paths reaches."""
    out: list[str] = []
    for v in place.variants:
        reached = set()
        for s in fm.scenario_names:
            reached |= fm.reached(v, s)
        out.extend(p for p in place.parameters if p not in reached and p not in out)
    return out


def reached_elsewhere(fm: FlowMap, place: Place) -> bool:
    """Every parameter the place cuts still gets a gradient from the step in those paths: from another
    term, or the same term through the tensor that was not detached."""
    return not unreached_by_step(fm, place)


def short_site(site: Mapping[str, Any]) -> str:
    """'cases.py:33 (.item())': a cut named beside another finding (its own finding shows the code)."""
    kind = str(site.get("kind"))
    return f"{os.path.basename(str(site.get('file')))}:{site.get('line')} ({SPELLING.get(kind, kind)})"


def leaves_terms_dead(fm: FlowMap, place: Place) -> bool:
    """Each term the place cuts reaches no parameter at all in its own scenario, in each of its paths
    (a term the cut left with nothing to train)."""
    for v in place.variants:
        for t in place.terms:
            scenario = _scenario_for(fm, t) if t != TOTAL else None
            if scenario is None:
                return False
            try:
                run = fm.run(v, scenario)
            except KeyError:
                return False
            if run.error is None and fm.count(v, scenario)[0] > 0:
                return False
    return bool(place.variants and place.terms)


def roots_for_others(fm: FlowMap, place: Place) -> list[Place]:
    """Where an explicit stop-gradient leaves parameters that no term reaches, the places that cut
    *other* terms off the same parameters and are errors on their own: a construct that is not an
    explicit stop-gradient (``.item()``, ``.data``, a cast...), or one that leaves its term reaching
    nothing at all (a loss term detached whole). Those are the roots. Empty unless they account for every
    such parameter, and for a place that itself leaves its term with nothing (it is a root)."""
    left = set(unreached_by_step(fm, place))
    if not left or leaves_terms_dead(fm, place):
        return []
    roots = [
        o
        for o in places(fm)
        if o.key != place.key
        and (not explicit(o.site) or leaves_terms_dead(fm, o))
        and set(o.terms) - set(place.terms)
        and left & set(o.parameters)
    ]
    covered = {p for o in roots for p in o.parameters}
    return roots if left <= covered else []


def classify(fm: FlowMap, place: Place) -> str:
    """The cause a place is reported under: an explicit stop-gradient the step works around is
    ``stop-gradient`` (a warning); a cut that leaves every parameter reached, only with wrong values,
    is ``gradient-mismatch``; the rest as ``cause_of`` says."""
    cause = cause_of(place.site)
    if cause != "graph-break-in-model":
        return cause
    # In the reference the construct is the user's method (a traced path records the same line as a graph
    # node); only in another path, it is that path departing from the reference.
    # Parameters it leaves unreached that another term would train but for a cut of its own (the root) do
    # not make it an error: the root is reported, and this one asks as it would once the root is fixed.
    if (
        explicit(place.site)
        and in_reference(fm, place.site)
        and (reached_elsewhere(fm, place) or roots_for_others(fm, place))
    ):
        return "stop-gradient"
    if place.statuses and all(st == WRONG for st in place.statuses.values()):
        return "gradient-mismatch"
    return cause


def fd_off(fm: FlowMap, variant: str, term: str) -> set[str]:
    """Parameters along which the gradients check found ``term``'s gradient in ``variant`` off its
    finite differences."""
    entry = (
        (((fm.checks.get("gradients") or {}).get("paths") or {}).get(variant) or {}).get("terms") or {}
    ).get(term)
    if not isinstance(entry, Mapping) or entry.get("status") != "disagrees":
        return set()
    return set(entry.get("parameters") or ())


def _confirmed(fm: FlowMap, variant: str) -> dict[str, set[str]]:
    """Leaving site id -> terms that finite differences showed to move with its parameters."""
    out: dict[str, set[str]] = {}
    for c in (fm.evidence.get("confirmations") or {}).get(variant) or []:
        if "key" in c:  # one site may have been moved once per group of terms
            out.setdefault(str(c["key"]), set()).update(c.get("confirmed") or ())
    return out


def places(fm: FlowMap) -> list[Place]:
    """Every cut site that costs some term a parameter (or its gradient's value), in some path, merged by
    place; a site that only follows another in a chain is listed under that one (``Place.later``)."""
    merged: dict[tuple[Any, ...], Place] = {}
    later: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for variant, lin in (fm.evidence.get("lineage") or {}).items():
        if lin.get("error") or variant not in fm.variant_names:
            continue
        sites = {s["id"]: s for s in lin.get("sites") or ()}
        confirmed = _confirmed(fm, variant)
        for term, tl in (lin.get("terms") or {}).items():
            scenario = _scenario_for(fm, term)
            missing = unreached_in(fm, variant, scenario) if scenario is not None else None
            if missing is None:
                continue
            off = fd_off(fm, variant, term) - set(missing)
            statuses = {**missing, **dict.fromkeys(off, WRONG)}
            if not statuses:
                continue
            carried = set(tl.get("depends_on") or ()) - set(tl.get("cut") or ())
            cut = [p for p in tl.get("cut") or () if p in missing]
            found: list[tuple[dict[str, Any], list[str]]] = []
            for sid in tl.get("sites") or ():
                site = sites.get(sid)
                if site is None or site.get("kind") in LEAVING:
                    continue
                params = site.get("parameters") or ()
                # A custom Function cuts nothing: it is blamed only where its gradient was measured off.
                hit = [] if site.get("kind") == FUNCTION else [p for p in cut if p in params]
                hit += [p for p in params if p in off and p not in hit]
                if hit:
                    found.append((site, hit))
            # Dependence that left torch: blamed only where finite differences confirmed it, and only for
            # parameters no cut in the term's own history explains (the lineage cannot tell which term's
            # value a Python number flowed into).
            explained = {p for _, hit in found for p in hit}
            for site in sites.values():
                if site.get("kind") in LEAVING and (
                    term in confirmed.get(str(site["id"]), set())
                    or (off - explained) & set(site.get("parameters") or ())
                ):
                    hit = [
                        p
                        for p in site.get("parameters") or ()
                        if p in statuses and p not in carried and p not in explained
                    ]
                    if hit:
                        found.append((site, hit))
            hits = {site["id"]: hit for site, hit in found}
            for site, hit in found:
                earlier = [
                    i for i in site.get("after") or () if i in hits and sites[i].get("kind") != FUNCTION
                ]
                if earlier:  # a later link of a chain: reported with the first, for what the first cuts
                    later.setdefault(_key(sites[earlier[0]]), []).append(site)
                    covered = {p for i in earlier for p in hits[i]}
                    hit = [p for p in hit if p not in covered]  # what only this site cuts: its own root
                    if not hit:
                        continue
                _add(merged, site, variant, term, hit, statuses)
    for key, place in merged.items():
        for site in later.get(key, ()):
            if site not in place.later:
                place.later.append(site)
    return _fold_into_reference(list(merged.values()), fm.reference)


def _line_of(site: Mapping[str, Any]) -> tuple[Any, ...] | None:
    file, line = site.get("file"), site.get("line")
    return None if file is None or line is None else (site.get("kind"), os.path.basename(str(file)), line)


def _fold_into_reference(found: list[Place], reference: str) -> list[Place]:
    """A traced path records the reference's cut as a graph node at the same line of the user's code:
    the same cut, one place (not a second finding saying it is "only in make_fx")."""
    at_line = {key: p for p in found if reference in p.variants and (key := _line_of(p.site)) is not None}
    out = []
    for place in found:
        into = at_line.get(_line_of(place.site)) if reference not in place.variants else None  # type: ignore[arg-type]
        # Not a detach make_fx put on a tensor saved for backward at that line: that one is the trace's own.
        if into is None or cause_of(place.site) != cause_of(into.site):
            out.append(place)
            continue
        for v in place.variants:
            if v not in into.variants:
                into.variants.append(v)
            into.sites.setdefault(v, place.sites[v])
        for t in place.terms:
            if t not in into.terms:
                into.terms.append(t)
        for p in place.parameters:
            if p not in into.parameters:
                into.parameters.append(p)
                into.statuses[p] = place.statuses[p]
        for k, hit in place.hits.items():
            into.hits.setdefault(k, []).extend(p for p in hit if p not in into.hits.get(k, ()))
        into.later.extend(s for s in place.later if s not in into.later)
    return out


def _key(site: Mapping[str, Any]) -> tuple[Any, ...]:
    return (site.get("kind"), site.get("file"), site.get("line"), site.get("node"))


def _add(
    merged: dict[tuple[Any, ...], Place],
    site: dict[str, Any],
    variant: str,
    term: str,
    hit: Iterable[str],
    missing: Mapping[str, str],
) -> None:
    place = merged.setdefault(_key(site), Place(site))
    place.hits.setdefault((variant, term), []).extend(
        p for p in hit if p not in place.hits.get((variant, term), ())
    )
    place.sites.setdefault(variant, site)
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


def term_names(place: Place) -> list[str]:
    """The place's terms as a finding names them (the step's total spelled out)."""
    return ["the total loss" if t == TOTAL else t for t in place.terms]


def place_notes(fm: FlowMap, place: Place) -> dict[str, str]:
    """The user's ``notes`` on the cut parameters, by parameter (all of them: the cut is declared)."""
    return {p: n for p in place.parameters if (n := note_for(p, fm.notes)) is not None}


def place_evidence(fm: FlowMap, place: Place) -> dict[str, Any]:
    """What a finding at a place records: the site, where it was seen, and the runs it explains."""
    return {
        "site": place.site,
        "variants": place.variants,
        "terms": place.terms,
        "parameters": place.parameters,
        "statuses": place.statuses,
        "runs": explained_runs(fm, place),
    }


def status_words(place: Place) -> str:
    """'no gradient: a, b; exact zero: c; a gradient off its finite differences: d' for the cut parameters."""
    parts = []
    for status, words in (("none", "no gradient"), ("zero", "exact zero"),
                          (WRONG, "a gradient off its finite differences")):  # fmt: skip
        shown = [p for p, st in place.statuses.items() if st == status]
        if shown:
            parts.append(f"{words}: {names(shown)}")
    return "; ".join(parts)


def lost_words(place: Place) -> str:
    """'3 parameter(s) the gradient does not reach' (or 'does not reach or gets wrong' where the
    gradients check measured some of them reached with a wrong value)."""
    wrong = any(st == WRONG for st in place.statuses.values())
    return f"{len(place.parameters)} parameter(s) the gradient does not reach" + (
        " or gets wrong" if wrong else ""
    )


def where_seen(fm: FlowMap, place: Place) -> str:
    """'every path' when the reference has it too, else the paths."""
    if fm.reference in place.variants:
        return (
            "in the reference path (and every path that runs the same code)" if len(fm.variants) > 1 else ""
        )
    return "only in " + ", ".join(place.variants)


SPELLING = {
    "detach": "detach()",
    "data": ".data",
    "no_grad": "an op under torch.no_grad()",
    "inference_mode": "an op under torch.inference_mode()",
    "item": ".item()",
    "float": "float()",
    "tolist": ".tolist()",
    "numpy": ".numpy()",
    "int_cast": "an integer cast",
    "non_differentiable": "an op whose output carries no gradient",
    "autograd_grad_no_create_graph": "torch.autograd.grad without create_graph",
    "custom_function": "a custom autograd.Function",
}


def chain_words(place: Place) -> str:
    """'; the value is cut again later at x.py:12 (.item())' for the later links of a chain."""
    if not place.later:
        return ""
    from .common import where

    shown = [f"{where(s)} ({SPELLING.get(str(s.get('kind')), s.get('kind'))})" for s in place.later[:3]]
    return (
        "; the same value is cut again after it at "
        + ", ".join(shown)
        + " (a consequence: this is the first cut)"
    )


def fd_words(fm: FlowMap, place: Place) -> str:
    """What the gradients check measured for the place's terms in its paths: the largest relative gap
    between autograd and the finite differences, where it was measured off."""
    gaps = []
    for v in place.variants:
        for t in place.terms:
            entry = (
                (((fm.checks.get("gradients") or {}).get("paths") or {}).get(v) or {}).get("terms") or {}
            ).get(t)
            if isinstance(entry, Mapping) and entry.get("status") == "disagrees":
                gaps.append((float(entry.get("rel_error") or 0.0), v, t))
    if not gaps:
        return ""
    gap, v, t = max(gaps)
    return f"finite differences of {t} ({v}) differ from its gradient by {gap:.0%} along these parameters"


def reached_claims(fm: FlowMap, place: Place) -> list[Any]:
    """That the step still trains the place's parameters: per path, the runs that reach them."""
    from ..claims import claim

    out = []
    for v in place.variants:
        left = set(place.parameters)
        for s in fm.scenario_names:
            got = sorted(left & fm.reached(v, s))
            if got:
                out.append(claim("statuses", f"{s} in {v} reaches {names(got)}", variant=v, scenario=s,
                                 parameters=got, status=["nonzero"]))  # fmt: skip
                left -= set(got)
    return out


def place_claims(fm: FlowMap, place: Place) -> list[Any]:
    """The facts a place rests on, per path and term, as claims (``gradprobe.claims``): the site the
    lineage recorded, the term's dependence on the parameters, their measured statuses (no gradient,
    exact zero) or the gradients check's disagreement along them."""
    from ..claims import claim
    from .common import where

    out = []
    for variant, site in place.sites.items():
        carried = sorted({p for (v, _), ps in place.hits.items() if v == variant for p in ps})
        kind = str(site.get("kind"))
        out.append(
            claim(
                "site",
                f"{SPELLING.get(kind, kind)} at {where(site)}",
                variant=variant,
                kind=kind,
                file=site.get("file"),
                line=site.get("line"),
                parameters=carried,
            )
        )
    for (variant, term), hit in place.hits.items():
        shown = "the total loss" if term == TOTAL else term
        scenario = _scenario_for(fm, term)
        if place.site.get("kind") not in LEAVING and term != TOTAL:
            out.append(claim("depends", f"{shown}'s value depends on {names(hit)} ({variant})",
                             variant=variant, term=term, parameters=hit))  # fmt: skip
        lost = [p for p in hit if place.statuses.get(p) in ("none", "zero")]
        if lost and scenario is not None:
            run = fm.run(variant, scenario)
            if run.error is not None:
                out.append(claim("run_failed", f"{scenario} in {variant} has no gradient path ({run.error.type})",
                                 variant=variant, scenarios=[scenario], type=run.error.type))  # fmt: skip
            else:
                out.append(claim("statuses", f"in {variant}, {scenario}: no gradient or exact zero for {names(lost)}",
                                 variant=variant, scenario=scenario, parameters=lost, status=["none", "zero"]))  # fmt: skip
        wrong = [p for p in hit if p in fd_off(fm, variant, term)]
        if wrong:
            entry = fm.checks["gradients"]["paths"][variant]["terms"][term]
            gap = float(entry.get("rel_error") or 0.0)
            out.append(
                claim(
                    "fd",
                    f"finite differences of {shown} ({variant}) differ from its gradient by {gap:.0%} along "
                    f"{names(wrong)}",
                    variant=variant,
                    term=term,
                    status="disagrees",
                    parameters=wrong,
                    at_least=gap,
                )
            )
    return out
