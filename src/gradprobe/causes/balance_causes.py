"""Why a reached term still stays flat (evidence: the balance check, ``checks=["balance"]``).

term-dominated (warning): a term's share of every group it reaches is below 1 %.
terms-conflict (warning): two terms' gradients point in opposite directions (cosine < -0.5), with
  evidence that it hurts: one of them does not decrease in the training check, or at least one is an
  independent data term. Two derivatives of one energy (force and virial) conflict by construction:
  without a training check that shows harm, that is info.
not-in-optimizer (error): parameters a term reaches are in no optimizer group (a parameter filter).
zero-learning-rate (error): parameters a term reaches are in a group with lr 0.
frozen-but-needed (warning): a term would reach parameters that are frozen.
clip-swallows-term (error): gradient clipping, set by another term's norm, shrinks a term's update 100×.
"""

from __future__ import annotations

from ..claims import claim
from ..flowmap import Finding, FlowMap
from ..wording import names


def _percent(share: float) -> str:
    """Two significant digits, so a share of 1e-6 reads 0.00012%, not 0.00%."""
    return f"{share:.1%}" if share >= 0.001 else f"{share * 100:.2g}%"


def _against(d: dict) -> str:
    """'virial has 95.9% and energy 4.1%': the terms that drown it, by share (older maps: the largest)."""
    others = d.get("others") or {d["by"]: None}
    parts = [
        f"{u} {'has ' if i == 0 else ''}{'' if v is None else _percent(v)}".strip()
        for i, (u, v) in enumerate(others.items())
    ]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def detect(fm: FlowMap) -> list[Finding]:
    b = fm.checks.get("balance")
    if not b or b.get("error"):  # a balance check that could not run is failed_checks' finding
        return []
    out = []
    schedule = b.get("prefactor_schedule") or {}
    for d in b["dominated"]:
        by_design = d.get("share_at_limit") is not None and d["share_at_limit"] >= 0.01
        when = (
            f" at {schedule.get('step', 'the current step')} (prefactors "
            + ", ".join(f"{t} {v:g}" for t, v in (schedule.get("now") or {}).items())
            + ")"
            if schedule
            else ""
        )
        tail = (
            "; the prefactor schedule ends at "
            + ", ".join(f"{t} {v:g}" for t, v in (schedule.get("limit") or {}).items())
            + f", where its share is {d['share_at_limit']:.1%}"
            + (": drowned now by design of the schedule" if by_design else ": still drowned there")
            if d.get("share_at_limit") is not None
            else ""
        )
        out.append(Finding(
            "term-dominated", "info" if by_design else "warning",
            f"term {d['term']} is drowned{when}: at most {_percent(d['share'])} of the gradient in every group it "
            f"reaches; in {d['group']}, its best, {_against(d)}, so it barely moves the parameters{tail}",
            evidence={"dominated": d, "shares": {t: b["shares"][t] for t in (d["term"], d["by"])}},
            location={"term": d["term"], "group": d["group"]},
            claims=(claim("dominated", f"term {d['term']}: at most {_percent(d['share'])} of the gradient in every "
                          f"group it reaches ({d['group']} its best)", term=d["term"], group=d["group"],
                          share=d["share"]),),
            fix=(
                "nothing to do if the schedule is intended: the term catches up as its prefactor grows"
                if by_design
                else f"multiply the {d['term']} prefactor by about {d['prefactor_factor']:.3g} (for a 10% share in "
                f"{d['group']}), or lower the others'; with a prefactor schedule, check the values at the current step"
            ),
        ))  # fmt: skip
    training = fm.checks.get("training") or {}
    verdicts = training.get("verdicts") or {}
    for c in b["conflicts"]:
        if c["cosine"] >= -0.5:
            continue
        bad = [g for g, cos in c["groups"].items() if cos < -0.5]
        a, z = c["terms"]
        stuck = sorted(
            f"{t} {v} in {path}" for path, vs in verdicts.items() for t, v in vs.items()
            if t in (a, z) and v != "decreases"
        )  # fmt: skip
        derived = c.get("derived")
        by_construction = derived is not None and all(derived)
        trained = bool(verdicts) and not training.get("error")
        if stuck:
            why, severity = f"; it hurts: the training check has {', '.join(stuck)}", "warning"
        elif by_construction:
            why = "; both are computed from a gradient taken inside the step (derivatives of one energy)" + (
                "; both decrease in the training check" if trained else "; no training check ran to show harm"
            )
            severity = "info"
        else:
            indep = [t for t, d in zip(c["terms"], derived or [False, False], strict=True) if not d]
            why = f"; {' and '.join(indep)} {'is an independent data term' if len(indep) == 1 else 'are independent data terms'}"
            severity = "warning"
        out.append(Finding(
            "terms-conflict", severity,
            f"terms {a} and {z} pull the shared parameters in opposite directions (cosine {c['cosine']:.2f}; "
            f"in {', '.join(bad)}){why}",
            evidence={"conflict": c, "training": {"not_decreasing": stuck} if trained else None},
            location={"terms": c["terms"], "groups": bad},
            claims=(
                claim("conflict", f"the gradients of {a} and {z} have cosine {c['cosine']:.2f}", terms=list(c["terms"]),
                      cosine=c["cosine"], derived=list(derived) if by_construction else None),
                *(claim("trained", f"{t} {v} in {path}", variant=path, term=t, verdict=v)
                  for path, vs in verdicts.items() for t, v in vs.items() if t in (a, z) and v != "decreases"),
                *(claim("trained", f"{t} decreases in {path}", variant=path, term=t, verdict="decreases")
                  for path, vs in verdicts.items() for t, v in vs.items()
                  if t in (a, z) and by_construction and trained and not stuck),
            ),
            fix=(
                "nothing to do while both train: two derivatives of one energy share its gradient; "
                "run --check training to see them decrease"
                if severity == "info"
                else "check that the two terms' labels are consistent (units, reference energies, sign "
                "conventions); if the conflict is real, weigh or schedule them (or use a multi-task "
                "gradient method)"
            ),
        ))  # fmt: skip
    opt = b.get("optimizer") or {}
    for key, cause, what in (
        ("not_in_optimizer", "not-in-optimizer", "are in no optimizer parameter group"),
        ("zero_lr", "zero-learning-rate", "are in an optimizer group with learning rate 0"),
    ):
        found = opt.get(key) or {}
        if found:
            terms = sorted({t for ts in found.values() for t in ts})
            out.append(Finding(
                cause, "error",
                f"{len(found)} parameter(s) that {', '.join(terms)} reach {what}: {names(list(found))} — "
                "their gradients are computed and thrown away",
                evidence={"parameters": list(found), "terms": terms},
                location={"parameters": list(found)},
                claims=(claim("optimizer_gap", f"{names(list(found))} {what}", key=key, parameters=list(found)),),
                fix="build the optimizer from model.parameters() (check parameter filters and groups), and "
                "give every group a non-zero learning rate",
            ))  # fmt: skip
    for t, ps in (b.get("frozen") or {}).items():
        out.append(Finding(
            "frozen-but-needed", "warning",
            f"term {t} would reach {len(ps)} frozen parameter(s): {names(ps)}",
            evidence={"term": t, "parameters": ps},
            location={"parameters": ps},
            claims=(claim("frozen_needed", f"term {t} would reach {names(ps)}, which are frozen", term=t,
                          parameters=list(ps)),),
            fix="unfreeze them (requires_grad_(True)) if the term should train them",
        ))  # fmt: skip
    clip = b.get("clipping")
    if clip:
        for t, c in clip["terms"].items():
            if c["relative_update"] < 0.01:
                top = max(clip["terms"], key=lambda u: clip["terms"][u]["norm"])
                out.append(Finding(
                    "clip-swallows-term", "error",
                    f"clip_grad_norm(max_norm={clip['max_norm']:g}) scales the joint gradient by {clip['scale']:.2g} "
                    f"(total norm {clip['total_norm']:.3g}, set by {top}): {t}'s update is "
                    f"{c['relative_update']:.2g}× what it would be alone",
                    evidence={"clipping": clip, "term": t},
                    location={"term": t},
                    claims=(claim("clipped", f"{t}'s update is {c['relative_update']:.2g}× what it would be alone",
                                  term=t, relative_update=c["relative_update"]),),
                    fix=f"raise max_norm, clip per term, or rebalance the prefactors so {top} does not set the clip",
                ))  # fmt: skip
    return out
