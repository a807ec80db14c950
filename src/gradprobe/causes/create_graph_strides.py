"""create-graph-tangent-strides: torch 2.13's AOTAutograd restrides an incoming gradient whose strides
differ from the traced ones (``coerce_to_expected_memory_format``) by copying into a fresh tensor that
requires grad; under ``create_graph=True`` that gradient requires grad, and the copy raises "a leaf
Variable that requires grad is being used in an in-place operation". Seen on TorchANI 2.9 with the
model compiled (``compile_model:aot_eager``, forces by ``torchani.grad.forces_for_training``), and as
what ``donated_buffer=False`` exposes after donated-buffers.

Evidence: the message *and* the recorded traceback frame ``coerce_to_expected_memory_format`` (the
message alone is an ordinary user error in eager code); the user's frame (the ``autograd.grad`` call).
"""

from __future__ import annotations

from ..flowmap import Finding, FlowMap, RunError
from .common import at_user, failing_variants, in_frames, runs_of

CAUSE = "create-graph-tangent-strides"
MESSAGE = "a leaf Variable that requires grad is being used in an in-place operation"
FRAME = "coerce_to_expected_memory_format"

FIX = (
    "keep create_graph=True out of the compiled region's backward: compute forces in a path that compiles "
    "only first-order graphs (make_fx[detach=alias]+compile:<backend>, forces via torch.func.grad, or "
    "torch._dynamo.config.trace_autograd_ops=True), or compile with backend='eager'; making the compiled "
    "module's outputs contiguous before they are summed (so the incoming gradient has the traced strides) "
    "avoids the restriding"
)
NEXT = (
    "what it exposes next: with the strides matched, the create_graph backward is still AOTAutograd's own "
    "and cannot be differentiated (double-backward-unsupported): energy trains compiled, forces do not"
)


def matches(error: RunError) -> bool:
    return MESSAGE in error.message and in_frames(error, FRAME)


def detect(fm: FlowMap) -> list[Finding]:
    findings = []
    for v, failed, first in failing_variants(fm, matches):
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
                fix=f"{FIX}. {NEXT}",
            )
        )
    return findings
