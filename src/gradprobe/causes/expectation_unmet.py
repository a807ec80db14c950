"""expectation-unmet (error): the flow breaks what the spec declares (``expect=``).

Evidence: the measured cells of each run against ``fm.expect`` (declarations.unmet), and, for a lost
parameter, the lineage cut site on the path from it to one of the scenario's terms (with ``--diagnose``),
so the finding says where the gradient stops. Declared in one place with ``notes`` (declarations.py):
a parameter both expected and noted as intended-unreached is a contradiction and is reported as such.
"""

from __future__ import annotations

from ..claims import claim
from ..declarations import note_for, unmet
from ..flowmap import Finding, FlowMap
from ..wording import names
from .common import where
from .lineage_cuts import SPELLING, places

CAUSE = "expectation-unmet"


def detect(fm: FlowMap) -> list[Finding]:
    if not fm.expect:
        return []
    located = places(fm) if fm.evidence.get("lineage") else []
    diagnosed = bool(fm.evidence.get("lineage"))
    out = []
    for u in unmet(fm, fm.expect):
        terms = set(next(s.terms for s in fm.scenarios if s.name == u.scenario))
        sites = [
            p.site for p in located
            if u.variant in p.variants and terms & set(p.terms) and set(p.parameters) & set(u.parameters)
        ]  # fmt: skip
        statuses = dict(zip(u.parameters, u.statuses, strict=True))
        declared = list(fm.expect[u.scenario][u.kind])
        claims = [
            claim("expected", f"declared: {u.scenario} {u.kind.replace('_', ' ')} {_declared(fm, u)}",
                  scenario=u.scenario, kind=u.kind, declared=declared)
        ]  # fmt: skip
        by_status: dict[str, list[str]] = {}
        for p, st in statuses.items():
            by_status.setdefault(st, []).append(p)
        for st, ps in by_status.items():
            claims.append(claim("statuses", f"{u.scenario} in {u.variant}: {st} for {names(ps)}", variant=u.variant,
                                scenario=u.scenario, parameters=ps, status=[st]))  # fmt: skip
        for site in sites[:3]:
            kind = str(site.get("kind"))
            claims.append(claim("site", f"{SPELLING.get(kind, kind)} at {where(site)}", variant=u.variant,
                                kind=kind, file=site.get("file"), line=site.get("line")))  # fmt: skip
        if u.kind == "reaches":
            zero = [p for p, st in statuses.items() if st == "zero"]
            how = "no gradient" if not zero else (
                "an exact zero gradient" if len(zero) == len(statuses) else f"no gradient ({len(zero)} exact zero)"
            )  # fmt: skip
            message = (
                f"{u.scenario} in {u.variant}: declared to reach {_declared(fm, u)}, but "
                f"{len(u.parameters)} parameter(s) get {how}: {names(u.parameters)}"
            )
            noted = sorted({n for p in u.parameters if (n := note_for(p, fm.notes)) is not None})
            if noted:
                claims.append(claim("noted", "declared in notes", parameters=[
                    p for p in u.parameters if note_for(p, fm.notes) is not None]))  # fmt: skip
                message += (
                    f" (notes call them unreached by design: {'; '.join(noted)}: expect and notes disagree)"
                )
            if sites:
                message += "; the gradient stops at " + "; ".join(where(s) for s in sites[:3])
            fix = (
                f"remove the cut at {where(sites[0])}, or correct the declaration"
                if sites
                else "find where the chain from these parameters to the scenario's terms is cut"
                + ("" if diagnosed else " (run with --diagnose to locate it)")
                + ", or correct the declaration"
            )
        else:
            message = (
                f"{u.scenario} in {u.variant}: declared not to reach {_declared(fm, u)}, but it reaches "
                f"{len(u.parameters)} parameter(s): {names(u.parameters)}"
            )
            fix = "detach the path the declaration rules out (a frozen encoder, a target network), or correct the declaration"
        out.append(
            Finding(
                CAUSE,
                "error",
                message,
                evidence={
                    "variant": u.variant,
                    "scenario": u.scenario,
                    "kind": u.kind,
                    "declared": fm.expect[u.scenario][u.kind],
                    "parameters": list(u.parameters),
                    "statuses": statuses,
                    "sites": sites,
                    "runs": [[u.variant, u.scenario]],
                },
                claims=tuple(claims),
                location={
                    **(sites[0] if sites else {}),
                    "variant": u.variant,
                    "scenario": u.scenario,
                    "parameters": list(u.parameters),
                },
                fix=fix,
            )
        )
    return out


def _declared(fm: FlowMap, u) -> str:  # type: ignore[no-untyped-def]
    return ", ".join(repr(p) for p in fm.expect[u.scenario][u.kind])
