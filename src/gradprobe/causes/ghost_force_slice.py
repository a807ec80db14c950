"""ghost-force-slice: per-atom forces are wrong and the force sum rule is broken while gradient counts
agree everywhere — the signature of forces on periodic images (ghost atoms) sliced away instead of
scatter-summed onto their local atoms through ``mapping``. Evidence comes from the physics check."""

from __future__ import annotations

from ..flowmap import Finding, FlowMap

CAUSE = "ghost-force-slice"


def signature(physics: dict) -> bool:  # type: ignore[type-arg]
    """Forces off -dE/dx *and* the sum rule broken: the ghost-atom slicing signature."""
    force, sum_rule = physics.get("force", {}), physics.get("sum_rule", {})
    error, residual = force.get("max_rel_error", 0.0), sum_rule.get("relative", 0.0)
    # Finite and off: NaN forces are another failure (forces-not-conservative names it).
    finite = error == error and residual == residual and abs(error) != float("inf")
    return bool(finite and error > 1e-6 and residual > 1e-8 and not physics.get("cuts"))


def detect(fm: FlowMap) -> list[Finding]:
    physics = fm.checks.get("physics")
    if not physics or physics.get("passed", True) or physics.get("error") or not signature(physics):
        return []
    force, sum_rule = physics.get("force", {}), physics.get("sum_rule", {})
    worst = force.get("worst", {})
    return [
        Finding(
            CAUSE,
            "error",
            f"forces are not -dE/dx: off by up to {force['max_rel_error']:.0%} of the force scale (frame "
            f"{worst.get('frame')}, atom {worst.get('atom')}, {worst.get('direction')}: {worst.get('force', 0):.6g} vs "
            f"{worst.get('finite_difference', 0):.6g} by finite differences), and they do not sum to zero "
            f"(residual {sum_rule['max_residual']:.3g}), while every gradient count agrees: forces on periodic "
            "images (ghost atoms) are most likely sliced off (extended_force[:, :nloc]) instead of summed onto "
            "their local atoms",
            evidence={"physics": physics},
            location={"check": "physics"},
            fix="fold extended forces back with scatter_add through mapping: "
            "torch.zeros_like(f[:, :nloc]).scatter_add(1, mapping[..., None].expand(-1, -1, 3), extended_force)",
        )
    ]
