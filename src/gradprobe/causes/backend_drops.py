"""backend-drops-grads: counts or values change at one backend of the ladder and not before, with the
capture (and its detach handling) already right.

Evidence: a bisection whose first bad rung was *measured* to give other gradients (not an error:
a rung that raises is another cause), and measured differences in the path itself."""

from __future__ import annotations

from typing import Any

from ..claims import claim
from ..flowmap import Finding, FlowMap
from ..wording import op_name
from .common import Candidate, advice, differing, family, runs_of

CAUSE = "backend-drops-grads"
OWN = "the path's own backend"  # every override rung was right (evidence.bisect._generic_flips)


def detect(fm: FlowMap) -> list[Finding]:
    findings = []
    for b in fm.bisections:
        culprit = b.get("culprit") or {}
        if b.get("stage") != "compile" or not culprit.get("ladder"):
            continue
        v = b["variant"]
        if any("double backward" in (r.error.message if r.error else "") for r in fm.runs if r.variant == v):
            continue  # that is double-backward-unsupported
        broke = next(
            (t for t in b.get("trials") or () if t.get("knob") == "backend" and not t.get("ok")), None
        )
        # The path's own backend (every override rung was right) was measured by the probe itself.
        measured = "differs from the reference" in str((broke or {}).get("result", "")) or (
            broke is None and culprit.get("last_good") is not None
        )
        if not measured:
            continue  # the rung raised: another cause; no gradient was seen to differ
        # Only runs that ran and were compared: a raised run has no cells, so it never counts here.
        bad = [s for s in differing(fm, v) if fm.run(v, s).error is None]
        lost = sorted({p for s in bad for p, c in fm.differences(v, s).items()})
        if not bad or not lost:
            continue  # no gradient was measured to differ: no finding may claim one
        last = culprit.get("last_good")
        named = _culprit_pass(b.get("compiler_bisect"))
        inside = f"; torch's compiler bisector: {named}" if named else ""
        claims = [claim("differs", f"{', '.join(bad)} of {v} differ from {fm.reference} ({', '.join(lost[:6])})",
                        variant=v, scenarios=bad)]  # fmt: skip
        if broke is not None:
            claims.append(claim("trial", f"trial {broke['change']}: {broke['result']}", variant=v,
                                change=broke["change"], ok=False))  # fmt: skip
        capture = next((t for t in b.get("trials") or () if t.get("knob") in ("capture", "stance")), None)
        if capture is not None and capture.get("ok"):
            claims.append(claim("trial", f"trial {capture['change']}: {capture['result']}", variant=v,
                                change=capture["change"], ok=True))  # fmt: skip
        same = family(v)
        tips = (
            advice(
                fm,
                v,
                [
                    Candidate(
                        f"use backend {last} (the last good one on the ladder)",
                        lambda p, last=last, same=same: same(p) and p["backend"] == last,
                    )
                ],
                bad,
            )
            if last
            else None
        )
        findings.append(
            Finding(
                CAUSE,
                "error",
                (
                    f"{v}'s own backend (past {last} on the ladder) changes its gradients: {', '.join(bad)} differ "
                    f"from {fm.reference} ({', '.join(lost[:6])}); bisect: {b.get('summary')}"
                    if culprit["backend"] == OWN
                    else f"backend {culprit['backend']} changes the gradients of {v}: {', '.join(bad)} differ from "
                    f"{fm.reference} ({', '.join(lost[:6])})"
                    + (
                        "; the traced graph without it is right"
                        if capture is not None and capture.get("ok")
                        else ""
                    )
                    + (f", {last} is right too" if last else "")
                    + inside
                ),
                evidence={"variant": v, "runs": runs_of(v, bad), "bisection": b, "parameters": lost},
                location={"variant": v, "backend": culprit["backend"]},
                fix=(tips.text if tips is not None else "another backend (not tried)")
                + (
                    f"{inside}: keep that pass/decomposition out (its config, or the op outside the compiled region)"
                    + (
                        "; a random op draws another random stream there, which is not wrong arithmetic: "
                        "compare with the op made deterministic (eval mode, p=0) before changing the backend"
                        if any(w in inside for w in ("dropout", "rand", "bernoulli"))
                        else ""
                    )
                    if inside
                    else "; name the pass inside the backend with compiler_bisect=True (--compiler-bisect: "
                    "torch's CompilerBisector, one rebuild per trial)"
                ),
                claims=(*claims, *(tips.claims if tips is not None else ())),
            )
        )
    return findings


def _culprit_pass(found: dict[str, Any] | None) -> str:
    """ "aot_eager_decomp_partition's decomposition #4 (aten.native_dropout)", or "" when torch's compiler
    bisector (``evidence.compiler_passes``) named no subsystem."""
    r = (found or {}).get("result")
    if not r or not r.get("subsystem"):
        return ""
    op = op_name(r.get("debug_info"))
    return (
        f"{r['backend']}'s {r['subsystem']}"
        + (f" #{r['bisect_number']}" if r.get("bisect_number") else "")
        + (f" ({op})" if op else "")
    )
