"""gradient-mismatch: a term's gradient, as autograd gives it in a path, is not the derivative of the
term's value: the gradients check's finite differences along the parameters disagree with it beyond
what the arithmetic explains — whether or not any parameter lost its gradient.

* Located by the lineage at a cut that leaves every parameter reached (``autograd.grad`` without
  ``create_graph`` on one of two derivative routes, a weight used once through ``.data``): an error at
  the cut's line.
* Located at a custom ``autograd.Function`` in the term's history: its backward is not its forward's
  derivative. A surrogate gradient (a straight-through estimator) is exactly that and may be meant, so
  this is a warning that says so; declared in ``notes``, information.
* Not located (no lineage cut or Function explains it, or no lineage was recorded): an error that
  gives the measured gap and says the cause is not known.

Disagreements already explained by another cause's place (a cut that removes parameters from the
gradient, a stop-gradient) are reported by that cause, with the finite differences as its evidence."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..claims import claim
from ..flowmap import Finding, FlowMap
from ..wording import names
from .common import Explained, where
from .lineage_cuts import (
    FUNCTION,
    chain_words,
    classify,
    fd_words,
    place_claims,
    place_evidence,
    place_notes,
    places,
    term_names,
)

CAUSE = "gradient-mismatch"


def _checked(fm: FlowMap) -> dict[str, Any]:
    g = fm.checks.get("gradients")
    return (g.get("paths") or {}) if isinstance(g, Mapping) else {}


def detect(fm: FlowMap) -> list[Finding]:
    findings = []
    for place in places(fm):
        if not fd_words(fm, place) or classify(fm, place) != CAUSE:
            continue
        site = place.site
        terms = term_names(place)
        notes = place_notes(fm, place)
        declared = len(notes) == len(place.parameters)
        function = site.get("kind") == FUNCTION
        if function:
            message = (
                f"{', '.join(terms)}: the gradient through {site.get('op')} (a custom autograd.Function) at "
                f"{where(site)} is not the derivative of its forward: {fd_words(fm, place)} "
                f"({names(place.parameters)}). A surrogate gradient (straight-through) is meant to differ; "
                "any other backward is wrong"
            )
            fix = (
                "if the surrogate gradient is meant, declare it: notes={parameter prefix: why}; else correct the "
                "Function's backward (torch.autograd.gradcheck checks it in float64)"
            )
        else:
            message = (
                f"{', '.join(terms)}: the gradient is off its finite differences along {names(place.parameters)}: "
                f"{fd_words(fm, place)}. The value reaches them through a route autograd does not carry: "
                f"{site.get('op')} at {where(site)}" + chain_words(place)
            )
            fix = (
                "take that derivative with create_graph=True"
                if site.get("kind") == "autograd_grad_no_create_graph"
                else "compute the value from the tensor itself, not a copy of its data (no .data, no NumPy or "
                ".item() round trip), so autograd carries it"
            )
        findings.append(
            Finding(
                CAUSE,
                "info" if declared else ("warning" if function else "error"),
                message + (" — declared: " + "; ".join(sorted(set(notes.values()))) if declared else ""),
                evidence=place_evidence(fm, place),
                location={**site, "variants": place.variants},
                claims=(
                    *place_claims(fm, place),
                    *([claim("noted", "declared in notes", parameters=place.parameters)] if declared else []),
                ),
                fix="declared in notes: nothing to do" if declared else fix,
            )
        )
    return findings


def detect_unexplained(fm: FlowMap, explained: Explained | None = None) -> list[Finding]:
    """The disagreements nothing else explains, one finding per path (a generic detector: after the
    specific ones and flow-mismatch, which explain a path that differs from the reference)."""
    located = {
        (v, t) for place in places(fm) if fd_words(fm, place) for v in place.variants for t in place.terms
    }
    skip = explained.runs if explained is not None else set()
    lineage = fm.evidence.get("lineage") or {}
    findings = []
    for variant, result in _checked(fm).items():
        off = []
        for term, entry in (result.get("terms") or {}).items():
            runs = [(variant, s.name) for s in fm.scenarios if term in s.terms]
            if (
                entry.get("status") == "disagrees"
                and (variant, term) not in located
                and not all(r in skip for r in runs)
            ):
                off.append((term, entry))
        if not off:
            continue
        recorded = variant in lineage and not (lineage[variant] or {}).get("error")
        claims = [
            claim("fd", f"finite differences of {term} ({variant}) differ from its gradient by "
                  f"{float(e.get('rel_error') or 0):.0%} along {names(list(e.get('parameters') or ()))}",
                  variant=variant, term=term, status="disagrees", parameters=list(e.get("parameters") or ()),
                  at_least=float(e.get("rel_error") or 0))
            for term, e in off
        ]  # fmt: skip
        findings.append(
            Finding(
                CAUSE,
                "error",
                f"{variant}: the gradient is not the derivative of the term's value — "
                + "; ".join(c.text for c in claims)
                + "; cause not known: "
                + (
                    "no cut or custom Function in the recorded lineage explains it"
                    if recorded
                    else "run with diagnose=True (--diagnose) to record the lineage that can locate it"
                ),
                evidence={
                    "variant": variant,
                    "terms": [t for t, _ in off],
                    "runs": [[variant, s.name] for s in fm.scenarios if {t for t, _ in off} & set(s.terms)],
                    "gradients": {
                        t: {k: e.get(k) for k in ("rel_error", "parameters", "groups")} for t, e in off
                    },
                },
                location={"variant": variant},
                claims=tuple(claims),
                fix="compare the path's forward and backward for these parameters (torch.autograd.gradcheck)",
            )
        )
    return findings
