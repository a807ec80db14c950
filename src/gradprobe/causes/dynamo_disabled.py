"""dynamo-disabled: dynamo is switched off for the whole process (``TORCHDYNAMO_DISABLE=1`` in the
environment, or ``torch._dynamo.config.disable``), so every ``torch.compile`` ran the Python code
eagerly and the compiled paths measured nothing compiled. Not a recompile, not a problem of the step.

Evidence: the probe's record of the environment (``evidence.environment.dynamo_disabled``) and the
runs in which no compiled graph ran."""

from __future__ import annotations

from ..claims import claim
from ..flowmap import Finding, FlowMap

CAUSE = "dynamo-disabled"


def disabled(fm: FlowMap) -> dict | None:  # type: ignore[type-arg]
    """What the probe recorded of dynamo being off, or None."""
    found = (fm.evidence.get("environment") or {}).get("dynamo_disabled")
    return found if isinstance(found, dict) else None


def detect(fm: FlowMap) -> list[Finding]:
    off = disabled(fm)
    if off is None:
        return []
    eager = [
        (r.variant, r.scenario) for r in fm.runs if r.error is not None and r.error.type == "DynamoFallback"
    ]
    if not eager:
        return []
    variants = list(dict.fromkeys(v for v, _ in eager))
    by = (
        "TORCHDYNAMO_DISABLE=1 is set in the environment"
        if off.get("env") == "1"
        else "torch._dynamo.config.disable is True"
    )
    return [
        Finding(
            CAUSE,
            "error",
            f"{by}: nothing was compiled. "
            + "; ".join(
                f"{v} ran its Python eagerly in {sum(1 for w, _ in eager if w == v)} of {len(fm.scenarios)} "
                "scenario(s)"
                for v in variants
            )
            + ", so no compiled path was measured",
            evidence={"runs": [[v, s] for v, s in eager], "variants": variants, "dynamo_disabled": off},
            claims=(
                claim("environment", by, key="dynamo_disabled"),
                *(
                    claim(
                        "run_failed",
                        f"{v} ran no compiled code in {', '.join(s for w, s in eager if w == v)}",
                        variant=v,
                        scenarios=[s for w, s in eager if w == v],
                        type="DynamoFallback",
                    )
                    for v in variants
                ),
            ),
            fix="unset TORCHDYNAMO_DISABLE (and leave torch._dynamo.config.disable False) to probe the compiled paths"
            if off.get("env") == "1"
            else "set torch._dynamo.config.disable = False to probe the compiled paths",
        )
    ]
