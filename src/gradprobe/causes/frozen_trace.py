"""frozen-trace (from lineage): a replayed trace holds a value frozen at trace time where the Python
computed it from the parameters (``torch.tensor(x.tolist())``, ``torch.from_numpy(x.numpy())`` inside
the traced function become a graph constant), so the path's term no longer depends on them at all.

Evidence: the reference's term depends on parameters *by value* that the path's term does not depend
on even by value (not a cut: the dependence is gone), the path's gradient to them is none or zero,
and the path's lineage holds a graph constant (``lift_fresh_copy`` of a ``_tensor_constant``) in the
term's history. The same cause id as the second-batch check (``second_batch.py``), which catches
frozen values by their effect on another batch.
"""

from __future__ import annotations

from ..claims import claim
from ..flowmap import Finding, FlowMap
from ..wording import names
from .common import where
from .lineage_cuts import TOTAL, cause_of, unreached_in

CAUSE = "frozen-trace"


def detect(fm: FlowMap) -> list[Finding]:
    lineage = fm.evidence.get("lineage") or {}
    ref_terms = (lineage.get(fm.reference) or {}).get("terms") or {}
    findings = []
    for v in fm.variants:
        lin = lineage.get(v.name) or {}
        if v.name == fm.reference or lin.get("error"):
            continue
        sites = {s["id"]: s for s in lin.get("sites") or () if cause_of(s) == CAUSE}
        hits = []
        for term, tl in (lin.get("terms") or {}).items():
            ref = ref_terms.get(term)
            baked = [sites[i] for i in tl.get("sites") or () if i in sites]
            if ref is None or not baked or term == TOTAL:
                continue
            scenario = next((s.name for s in fm.scenarios if s.terms == (term,)), None)
            missing = unreached_in(fm, v.name, scenario) if scenario else None
            gone = [
                p
                for p in ref.get("depends_on") or ()
                if p not in (tl.get("depends_on") or ()) and p in (missing or {})
            ]
            if gone:
                hits.append((term, gone, baked[0], scenario))
        if not hits:
            continue
        first = hits[0][2]
        lost = sorted({p for _, gone, _, _ in hits for p in gone})
        terms = [t for t, _, _, _ in hits]
        claims = []
        for term, gone, site, scenario in hits:
            claims += [
                claim("site", f"graph constant {site.get('node')} in {term}'s history", variant=v.name,
                      kind=str(site.get("kind")), file=site.get("file"), line=site.get("line")),
                claim("independent", f"{term} does not depend on {names(gone)} in {v.name}", variant=v.name,
                      term=term, parameters=gone),
                claim("depends", f"{term} depends on {names(gone)} in {fm.reference}", variant=fm.reference,
                      term=term, parameters=gone),
            ]  # fmt: skip
            run = fm.run(v.name, scenario)
            if run.error is not None:
                claims.append(claim("run_failed", f"{scenario} in {v.name} has no gradient path ({run.error.type})",
                                    variant=v.name, scenarios=[scenario], type=run.error.type))  # fmt: skip
            else:
                claims.append(claim("statuses", f"{scenario} in {v.name}: no gradient or exact zero for {names(gone)}",
                                    variant=v.name, scenario=scenario, parameters=gone, status=["none", "zero"]))  # fmt: skip
        findings.append(
            Finding(
                CAUSE,
                "error",
                f"{v.name} froze a trace-time value into its graph: {', '.join(terms)} no longer depend(s) on "
                f"{names(lost)} (which {', '.join(terms)} depend(s) on in {fm.reference}) and use(s) a graph constant "
                f"at node {first.get('node')}"
                + (f" ({where(first)})" if first.get("file") else "")
                + ": a value computed from them when the graph was traced is a constant of the replayed graph",
                evidence={
                    "variant": v.name,
                    "sites": [h[2] for h in hits],
                    "lost": lost,
                    "runs": [[v.name, s.name] for s in fm.scenarios if set(s.terms) & set(terms)],
                },
                location={**first, "variant": v.name},
                fix="keep the value a tensor inside the traced function (no .tolist()/.numpy()/torch.tensor "
                "round trip), or pass it in as an input of the trace (not tried)",
                claims=tuple(claims),
            )
        )
    return findings
