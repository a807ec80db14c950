"""stop-gradient: an explicit stop-gradient the user wrote (``.detach()``, a ``torch.no_grad()`` block)
cuts a term off parameters its value depends on, and the step still trains those parameters another
way (another term, or the same term through the tensor that was not detached). That is how a GAN critic
on ``fake.detach()``, a self-supervised target branch, a target network or a linear probe on detached
features are written: only the user knows whether this one is meant, so it is a warning that asks.
Declared in ``notes``, it is information. A cut after which nothing trains those parameters any more
is not this: it is ``graph-break-in-model`` (an error).

Evidence: the lineage of the path's step (the construct, its line, the parameters cut), the measured
statuses of every term in that path (who still reaches them), and the gradients check's finite
differences where they ran (the value does move with those parameters)."""

from __future__ import annotations

from ..claims import claim
from ..flowmap import Finding, FlowMap
from ..wording import names
from .common import where
from .lineage_cuts import (
    SPELLING,
    classify,
    fd_words,
    place_claims,
    place_evidence,
    place_notes,
    places,
    reached_claims,
    reached_elsewhere,
    roots_for_others,
    short_site,
    term_names,
    unreached_by_step,
    where_seen,
)

CAUSE = "stop-gradient"


def detect(fm: FlowMap) -> list[Finding]:
    findings = []
    for place in places(fm):
        if classify(fm, place) != CAUSE:
            continue
        site = place.site
        terms = term_names(place)
        notes = place_notes(fm, place)
        declared = len(notes) == len(place.parameters)
        construct = SPELLING.get(str(site.get("kind")), str(site.get("kind")))
        seen = where_seen(fm, place)
        fd = fd_words(fm, place)
        roots = [] if reached_elsewhere(fm, place) else roots_for_others(fm, place)
        message = (
            f"stop-gradient at {where(site)} — intended? {', '.join(terms)}: the value depends on "
            f"{names(place.parameters)} through {construct}, which carries no gradient to them there; "
            + (
                "the step still trains them another way (another term, or the part of the value that is not "
                "detached)"
                if not roots
                else f"the step would train {names(unreached_by_step(fm, place))} through "
                + ", ".join(sorted({t for o in roots for t in term_names(o)}))
                + ", but that is cut on its own at "
                + ", ".join(short_site(o.site) for o in roots)
                + " (an error, reported there)"
            )
            + (f"; {fd}" if fd else "")
            + (f"; {seen}" if seen else "")
        )
        if declared:
            message += " — declared: " + "; ".join(sorted(set(notes.values())))
        findings.append(
            Finding(
                CAUSE,
                "info" if declared else "warning",
                message,
                evidence=place_evidence(fm, place),
                location={**site, "variants": place.variants},
                claims=(
                    *place_claims(fm, place),
                    *reached_claims(fm, place),
                    *(c for o in roots for c in place_claims(fm, o)),
                    *([claim("noted", "declared in notes", parameters=place.parameters)] if declared else []),
                ),
                fix="declared in notes: nothing to do"
                if declared
                else "if it is meant (a critic on detached samples, a target branch, a probe), declare it: "
                "notes={parameter prefix: why}; if not, remove the " + construct + " so the term trains them",
            )
        )
    return findings
