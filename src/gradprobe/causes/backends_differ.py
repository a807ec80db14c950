"""backends-differ: one model, moved between two backends of its package by the package's own
``serialize()``/``deserialize()``, computes other outputs or other gradients on the same batch.

Evidence: ``checks["backends"]`` (``DeepmdAdapter.compare_backends``: DeePMD's ``pt`` against
``pt_expt``): each output's difference relative to its scale (beyond 1e-10), each term's gradient per
serialized variable (beyond 1e-8), and variables trainable in one backend only. Where the reference
backend passes its own physics check, that is said too: the other backend is then the one to read.
"""

from __future__ import annotations

from typing import Any

from ..claims import claim
from ..flowmap import Finding, FlowMap

CAUSE = "backends-differ"


def detect(fm: FlowMap) -> list[Finding]:
    result = fm.checks.get("backends")
    if not isinstance(result, dict) or result.get("error") or result.get("passed", True):
        return []
    ref, other = result.get("reference", "reference"), result.get("other", "other")
    out_tol, grad_tol = float(result["rtol_outputs"]), float(result["rtol_grads"])
    bad_outputs = {k: e for k, e in (result.get("outputs") or {}).items() if not e <= out_tol}
    claims: list[Any] = [
        claim(
            "backend_output",
            f"{other}'s {k} differs from {ref}'s by {e:.3g} of its scale",
            output=k,
            at_least=float(e),
        )
        for k, e in bad_outputs.items()
    ]
    grads: dict[str, dict[str, float]] = {}
    for term, g in (result.get("grads") or {}).items():
        off = {v: e for v, e in (g.get("variables") or {}).items() if not e <= grad_tol}
        if not off:
            continue
        grads[term] = off
        worst = max(off, key=off.__getitem__)
        claims.append(
            claim(
                "backend_grad",
                f"the {term} term's gradient along {worst} differs by {off[worst]:.3g} "
                f"({len(off)} of {len(g.get('variables') or {})} serialized variables beyond {grad_tol:g})",
                term=term,
                variable=worst,
                at_least=float(off[worst]),
            )
        )
    unmatched = list(result.get("unmatched") or ())
    if unmatched:
        claims.append(
            claim(
                "backend_unmatched",
                f"trainable in one backend only: {', '.join(unmatched)}",
                variables=unmatched,
            )
        )
    if not claims:
        return []
    physics = fm.checks.get("physics")
    suspect = ""
    if isinstance(physics, dict) and physics.get("passed") and not physics.get("error"):
        claims.append(claim("check", f"{ref}'s forces and virial pass the physics check", name="physics",
                            passed=True))  # fmt: skip
        suspect = f"; {ref} passes its own physics check, so read {other}'s code first"
    message = (
        f"{other} and {ref} differ on the same weights (moved by {result.get('via', 'serialize()/deserialize()')}) "
        f"and the same batch: " + "; ".join(c.text for c in claims if c.kind != "check") + suspect
    )
    return [
        Finding(
            CAUSE,
            "error",
            message,
            evidence={
                "reference": ref,
                "other": other,
                "outputs": bad_outputs,
                "grads": {t: max(v.values()) for t, v in grads.items()},
                "variables": grads,
                "unmatched": unmatched,
            },
            location={
                "check": "backends",
                "backend": other,
                "outputs": list(bad_outputs),
                "terms": list(grads),
            },
            claims=tuple(claims),
            fix=f"compare how {other} and {ref} compute "
            + (", ".join(bad_outputs) or "the gradients named")
            + " from the same weights (the fold of extended-atom forces, the virial, the fitting's output): "
            "cause not known beyond the outputs and variables named",
        )
    ]
