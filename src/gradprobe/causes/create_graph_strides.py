"""create-graph-tangent-strides: torch 2.13's AOTAutograd restrides an incoming gradient whose strides
differ from the traced ones (``coerce_to_expected_memory_format``) by copying into a fresh tensor that
requires grad; under ``create_graph=True`` that gradient requires grad, and the copy raises "a leaf
Variable that requires grad is being used in an in-place operation". Seen on TorchANI 2.9 with the
model compiled (``compile_model:aot_eager``, forces by ``torchani.grad.forces_for_training``), and as
what ``donated_buffer=False`` exposes after donated-buffers.

Evidence: the message *and* the recorded traceback frame ``coerce_to_expected_memory_format`` (the
message alone is an ordinary user error in eager code); the user's frame (the ``autograd.grad`` call).
The ways around it are advice from trials (``common.advice``).
"""

from __future__ import annotations

from ..claims import claim
from ..flowmap import Finding, FlowMap, RunError
from .common import advice, at_user, failing_variants, failure_claims, in_frames, runs_of
from .double_backward import candidates

CAUSE = "create-graph-tangent-strides"
MESSAGE = "a leaf Variable that requires grad is being used in an in-place operation"
FRAME = "coerce_to_expected_memory_format"

NEXT = (
    "what it exposes next was not measured here; on torch 2.13 (SevenNet, TorchANI) with the strides "
    "matched the create_graph backward hit double-backward-unsupported"
)


def matches(error: RunError) -> bool:
    return MESSAGE in error.message and in_frames(error, FRAME)


def detect(fm: FlowMap) -> list[Finding]:
    findings = []
    for v, failed, first in failing_variants(fm, matches):
        claims = failure_claims(fm, v.name, failed, first, contains=MESSAGE)
        s0 = next((s for s in failed if fm.run(v.name, s).error == first), None)
        claims.append(claim("error_frame", f"the recorded traceback passes through {FRAME}", variant=v.name,
                            scenario=s0, function=FRAME))  # fmt: skip
        tips = advice(fm, v.name, candidates(v.name, separable=True), failed)
        findings.append(
            Finding(
                CAUSE,
                "error",
                f"{v.name} raises at {first.stage} in {', '.join(failed) or 'its build'}: a gradient entering its "
                "compiled backward with create_graph=True has strides other than the traced ones, and torch "
                f"{fm.torch_version}'s AOTAutograd restrides it in place on a leaf that requires grad "
                f"({FRAME}){at_user(first)}",
                evidence={"variant": v.name, "runs": runs_of(v.name, failed), "error": first, "next": NEXT},
                location={"variant": v.name, **(first.where or {})},
                fix="keep create_graph=True out of the compiled region's backward: "
                f"{tips.text}; or make the compiled module's outputs contiguous before they are summed, so the "
                f"incoming gradient has the traced strides (not tried). {NEXT[0].upper()}{NEXT[1:]}",
                claims=(*claims, *tips.claims),
            )
        )
    return findings
