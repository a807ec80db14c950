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
                hits.append((term, gone, baked[0]))
        if not hits:
            continue
        first = hits[0][2]
        lost = sorted({p for _, gone, _ in hits for p in gone})
        terms = [t for t, _, _ in hits]
        findings.append(
            Finding(
                CAUSE,
                "error",
                f"{v.name} froze a trace-time value into its graph: {', '.join(terms)} no longer depend(s) on "
                f"{names(lost)} (which {', '.join(terms)} depend(s) on in {fm.reference}) and use(s) a graph constant "
                f"at node {first.get('node')}"
                + (f" ({where(first)})" if first.get("file") else "")
                + ": a tensor turned into Python data (tolist, numpy) and back inside the traced function",
                evidence={
                    "variant": v.name,
                    "sites": [h[2] for h in hits],
                    "lost": lost,
                    "runs": [[v.name, s.name] for s in fm.scenarios if set(s.terms) & set(terms)],
                },
                location={**first, "variant": v.name},
                fix="keep the value a tensor inside the traced function (no .tolist()/.numpy()/torch.tensor "
                "round trip), or pass it in as an input of the trace",
            )
        )
    return findings
