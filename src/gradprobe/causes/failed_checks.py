"""Failed checks are findings: a check that fails or cannot run is an error, and sets the exit code.

* forces-not-conservative: the physics check finds forces that are not -dE/dx (or a broken sum
  rule, or a virial off the strain derivative) and the ghost-force signature does not explain it;
  located by the lineage of the energy path with the coordinates as sources (where the dependence on
  the coordinates stops carrying gradient).
* term-not-decreasing: the training check finds a term whose loss does not go down.
* check-could-not-run: a check, or a part of one, raised (the model cannot be copied, the step fails
  on a later call...).

The checks run on the reference's code (``energy_fn``/``predict`` on the model): when they fail, the
reference is the culprit, and ``flow-mismatch`` says so instead of blaming another path.
"""

from __future__ import annotations

import re
from typing import Any

from ..claims import claim
from ..flowmap import Finding, FlowMap
from .common import physics_results, where
from .ghost_force_slice import signature as ghost_signature


def detect(fm: FlowMap) -> list[Finding]:
    out: list[Finding] = []
    for name in ("physics", "training", "balance", "shape_sweep", "metrics", "backends", "gradients"):
        result = fm.checks.get(name)
        if isinstance(result, dict) and result.get("error") and result.get("passed") is False:
            out.append(_could_not_run(name, str(result["error"]), result.get("error_where"), check=name))
        elif name == "balance" and isinstance(result, dict) and isinstance(result.get("errors"), dict):
            # Parts of a check that could not run while the rest did (the balance check's effective
            # update on a model that cannot be copied, a step that raises on a later call).
            wheres = result.get("errors_where") or {}
            out.extend(
                _could_not_run(f"{name} ({part})", str(e), wheres.get(part), check=name, part=part)
                for part, e in result["errors"].items()
            )
    for path, physics in physics_results(fm):
        if physics.get("passed", True):
            continue
        if physics.get("error"):
            if path != fm.reference:  # the reference's own is reported above
                out.append(
                    _could_not_run(f"physics ({path})", str(physics["error"]), physics.get("error_where"),
                                   check="physics_paths", part=path)
                )  # fmt: skip
            continue
        own = [f for f in physics.get("failures") or () if "reference path" not in f]
        if own and not ghost_signature(physics):
            out.append(_not_conservative(fm, path, physics))
        if not own and physics.get("failures"):  # its own physics is right: only the outputs differ
            out.append(_outputs_differ(fm, path, physics, _reference_fails(fm)))
    training = fm.checks.get("training")
    if training and not training.get("error"):
        out.extend(_training(fm, training))
    return out


COPY = "CopyError"
# Python's own wording for an import that finds no module: the check needs a package this environment lacks.
MISSING_MODULE = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")


def _could_not_run(
    name: str,
    error: str,
    where_: dict[str, Any] | None,
    check: str,
    part: str | None = None,
    terms: dict[str, str] | None = None,
    wheres: dict[str, Any] | None = None,
) -> Finding:
    """A check, or a part of one, that raised: the recorded error and the user's frame it came from.
    Advice about copying only where the failure is a copy failure (``CopyError``, naming the
    attribute); otherwise the error is the step's (or the path's) as the check ran it."""
    claims = []
    if terms:  # the training check of one path, per term
        for t, e in terms.items():
            claims.append(claim("check_error", f"the training check of {part}, {t}: {e}", check=check, part=part,
                                term=t, contains=e))  # fmt: skip
            w = (wheres or {}).get(t) or {}
            if w.get("file") and w.get("line") is not None:
                claims.append(claim("check_where", f"{t}: the failure comes from {where(w)}", check=check,
                                    part=part, term=t, file=w["file"], line=w["line"]))  # fmt: skip
        where_ = next((w for w in (wheres or {}).values() if w), None)
    else:
        claims.append(
            claim("check_error", f"the {name} check: {error}", check=check, part=part, contains=error)
        )
        w = where_ or {}
        if w.get("file") and w.get("line") is not None:
            claims.append(claim("check_where", f"the failure comes from {where(w)}", check=check, part=part,
                                file=w["file"], line=w["line"]))  # fmt: skip
    at = f" (at {where(where_)})" if where_ else ""
    missing = MISSING_MODULE.search(error)
    if missing:
        fix = (
            f"the other measurements stand; the {name} check imports `{missing[1]}`{at}, which is not installed "
            f"in this environment: install the package that provides `{missing[1].split('.')[0]}` and run the "
            "check again"
        )
    elif COPY in error:
        fix = (
            "the other measurements stand; the check works on a deep copy of the model and the copy failed on the "
            "attribute the message names: make it copyable (define __deepcopy__ on its class, or drop the cached "
            "tensor or lock it holds) and run the check again"
        )
    else:
        fix = (
            f"the other measurements stand; the {name} check failed while running the step (or the path) as the "
            f"check runs it: {error}{at}. That failure is the step's own; fix it there and run the check again"
        )
    return Finding(
        "check-could-not-run",
        "error",
        f"the {name} check could not run: {error}{at}",
        evidence={"check": name, "error": error, "where": where_},
        location={
            "check": name,
            **({k: where_[k] for k in ("file", "line", "code") if k in where_} if where_ else {}),
        },
        fix=fix,
        claims=tuple(claims),
    )


def _reference_fails(fm: FlowMap) -> bool:
    physics = fm.checks.get("physics") or {}
    return bool(physics) and not physics.get("passed", True) and not physics.get("error")


def _outputs_differ(fm: FlowMap, path: str, physics: dict[str, Any], reference_fails: bool) -> Finding:
    outputs = physics.get("outputs") or {}
    bad = {k: e for k, e in outputs.items() if not e <= 1e-10}
    culprit = (
        f"; {fm.reference} itself fails the physics check and {path} passes its own: the reference is the culprit"
        if reference_fails
        else ""
    )
    return Finding(
        "outputs-differ",
        "warning" if culprit else "error",
        f"{path}'s own "
        + ", ".join(f"{k} (by {e:.2g} of its scale)" for k, e in bad.items())
        + f" differ from {fm.reference}'s on the same batch: the two paths compute different physics"
        + culprit,
        evidence={"variant": path, "outputs": outputs},
        location={"check": "physics", "variant": path, "outputs": list(bad)},
        fix="compare the two paths' energy, forces and virial on one batch (cause not known)",
        claims=(
            *(
                claim(
                    "outputs",
                    f"{path}'s {k} differs by {e:.2g} of its scale",
                    path=path,
                    output=k,
                    at_least=1e-10,
                )
                for k, e in bad.items()
            ),
            claim(
                "physics",
                f"{path}'s physics check fails only against the reference path",
                path=path,
                passed=False,
                failure="reference path",
            ),
            *(
                (
                    claim(
                        "physics",
                        f"{fm.reference} fails its own physics check",
                        path=fm.reference,
                        passed=False,
                    ),
                )
                if reference_fails
                else ()
            ),
        ),
    )


def _not_conservative(fm: FlowMap, path: str, physics: dict[str, Any]) -> Finding:
    cuts = physics.get("cuts") or []
    own = [f for f in physics.get("failures") or () if "reference path" not in f]
    message = f"{path}: " + "; ".join(own or ["the physics check fails"])
    claims = [
        claim("physics", f"the physics check of {path}: {f}", path=path, passed=False, failure=f) for f in own
    ]
    if cuts:
        c = cuts[0]
        message += (
            f"; the {c.get('path', 'energy')} path's dependence on the coordinates is cut by {c.get('kind')} at "
            f"{where(c)}"
        )
        claims.append(claim("physics_cut", f"{c.get('kind')} at {where(c)}", path=path, kind=c.get("kind"),
                            file=c.get("file"), line=c.get("line")))  # fmt: skip
    return Finding(
        "forces-not-conservative",
        "error",
        message,
        evidence={"physics": physics, "cuts": cuts, "variant": path},
        location={**cuts[0], "check": "physics", "variant": path}
        if cuts
        else {"check": "physics", "variant": path},
        fix="compute forces as -autograd.grad(E, coordinates) of the very energy that is trained, with nothing "
        "detached on the way from the coordinates to the energy",
        claims=tuple(claims)
        or (claim("physics", f"the physics check of {path} fails", path=path, passed=False),),
    )


def _training(fm: FlowMap, training: dict[str, Any]) -> list[Finding]:
    out = []
    errors = training.get("errors") or {}
    wheres = training.get("errors_where") or {}
    for variant, verdicts in (training.get("verdicts") or {}).items():
        built_failed = variant in fm.variant_names and fm.variant(variant).error is not None
        flat = {t: v for t, v in verdicts.items() if v in ("flat", "increases")}
        if flat:
            curves = training.get("curves", {}).get(variant, {})
            detail = ", ".join(f"{t} {v} ({_ends(curves.get(t))})" for t, v in flat.items())
            out.append(
                Finding(
                    "term-not-decreasing",
                    "error",
                    f"{variant}: in {training.get('steps')} {training.get('optimizer')} steps on a copy, {detail}: "
                    "training on this term does not lower it",
                    evidence={
                        "variant": variant,
                        "terms": list(flat),
                        "curves": {t: curves.get(t) for t in flat},
                        "runs": [[variant, f"{t} only"] for t in flat],
                    },
                    location={"variant": variant, "terms": list(flat)},
                    fix="cause not known from the curve alone: the flow findings of this term say what its "
                    "gradient reaches in this path",
                    claims=tuple(
                        claim(
                            "training",
                            f"{variant}: {t} {v} over the training check",
                            variant=variant,
                            term=t,
                            verdict=v,
                        )
                        for t, v in flat.items()
                    ),
                )
            )
        failed = {t: errors.get(variant, {}).get(t, "") for t, v in verdicts.items() if v == "error"}
        if failed and not built_failed:
            out.append(
                _could_not_run(
                    f"training ({variant})",
                    "; ".join(f"{t}: {e}" for t, e in failed.items()),
                    None,
                    check="training",
                    part=variant,
                    terms=failed,
                    wheres=wheres.get(variant),
                )
            )
    return out


def _ends(curve: list[float] | None) -> str:
    if not curve:
        return "no value"
    return f"{curve[0]:.4g} → {curve[-1]:.4g}"
