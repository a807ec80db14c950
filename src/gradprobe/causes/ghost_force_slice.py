"""ghost-force-slice: per-atom forces are wrong and the force sum rule is broken while gradient counts
agree everywhere — the signature of forces on periodic images (ghost atoms) sliced away instead of
scatter-summed onto their local atoms through ``mapping``. Evidence comes from the physics check."""

from __future__ import annotations

from ..claims import claim, same_counts
from ..flowmap import Finding, FlowMap
from .common import physics_results

CAUSE = "ghost-force-slice"


def signature(physics: dict) -> bool:  # type: ignore[type-arg]
    """Forces off -dE/dx *and* the sum rule broken: the ghost-atom slicing signature."""
    force, sum_rule = physics.get("force", {}), physics.get("sum_rule", {})
    error, residual = force.get("max_rel_error", 0.0), sum_rule.get("relative", 0.0)
    # Finite and off: NaN forces are another failure (forces-not-conservative names it). Below float64
    # the check states its own tolerances (issue 33).
    finite = error == error and residual == residual and abs(error) != float("inf")
    off = error > (force.get("tolerance") or 1e-6) and residual > (sum_rule.get("tolerance") or 1e-8)
    return bool(finite and off and not physics.get("cuts"))


def detect(fm: FlowMap) -> list[Finding]:
    failing = [
        (path, physics)
        for path, physics in physics_results(fm)
        if not physics.get("passed", True) and not physics.get("error") and signature(physics)
    ]
    if failing and failing[0][0] == fm.reference:
        # The reference has it: the paths that share its code show the same slice; one finding.
        return [_finding(fm, failing, [])]
    # A path that slices where the reference does not: its differing gradients are this, too.
    return [
        _finding(fm, [(path, physics)], [[path, s] for s in fm.scenario_names]) for path, physics in failing
    ]


def _finding(fm: FlowMap, failing: list[tuple[str, dict]], runs: list[list[str]]) -> Finding:  # type: ignore[type-arg]
    physics = failing[0][1]
    force, sum_rule = physics.get("force", {}), physics.get("sum_rule", {})
    worst = force.get("worst", {})
    claims = [
        claim("physics_off", f"{p}: forces off -dE/dx by up to {r['force']['max_rel_error']:.0%} of the force scale, "
              f"force sum residual {r['sum_rule']['max_residual']:.3g}", variant=p,
              force_off=float(r["force"]["max_rel_error"]), residual=float(r["sum_rule"]["max_residual"]),
              cut=False if "cuts" in r else None)
        for p, r in failing
    ]  # fmt: skip
    label = ", ".join(p for p, _ in failing)
    message = (
        f"{label}: forces are not -dE/dx: off by up to {force['max_rel_error']:.0%} of the force scale (frame "
        f"{worst.get('frame')}, atom {worst.get('atom')}, {worst.get('direction')}: {worst.get('force', 0):.6g} vs "
        f"{worst.get('finite_difference', 0):.6g} by finite differences), and they do not sum to zero "
        f"(residual {sum_rule['max_residual']:.3g})"
    )
    if "cuts" in physics:
        message += "; the lineage of the energy finds no cut in its dependence on the coordinates"
    others = [p for p, _ in failing if p != fm.reference]
    if others and same_counts(fm, others[0], list(fm.scenario_names)):
        message += f"; every gradient count of {others[0]} agrees with {fm.reference}"
        claims.append(claim("same_counts", f"every gradient count of {others[0]} agrees with {fm.reference}",
                            variant=others[0], scenarios=list(fm.scenario_names)))  # fmt: skip
    message += (
        ". This is the signature of forces on periodic images (ghost atoms) sliced off (extended_force[:, :nloc]) "
        "instead of summed onto their local atoms; the slice itself is not located"
    )
    return Finding(
        CAUSE,
        "error",
        message,
        evidence={"physics": physics, "variant": label, "runs": runs},
        location={"check": "physics", "variant": label},
        claims=tuple(claims),
        fix="fold extended forces back with scatter_add through mapping: "
        "torch.zeros_like(f[:, :nloc]).scatter_add(1, mapping[..., None].expand(-1, -1, 3), extended_force)",
    )
