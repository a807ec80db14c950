"""The catalogue of known causes: one module per cause.

Specific detectors are ``detect(fm) -> list[Finding]``; a finding lists the (variant, scenario) runs it
explains in ``evidence["runs"]`` and the parameters in ``evidence["parameters"]``. The generic detectors
(dead-term, run-failed, flow-mismatch, consistency-failed, unused-parameter) run last, in that order,
``detect(fm, explained)``, and report only what no cause before them explained.
"""

from __future__ import annotations

from collections.abc import Callable

from ..flowmap import Finding, FlowMap
from . import (
    backend_drops,
    backends_differ,
    balance_causes,
    compile_unsupported,
    consistency_failed,
    create_graph_detached,
    create_graph_strides,
    data_dependent_trace,
    ddp_globally_unused,
    ddp_locally_unused,
    dead_term,
    donated_buffers,
    double_backward,
    dynamo_disabled,
    dynamo_internal,
    expectation_unmet,
    failed_checks,
    flow_mismatch,
    frozen_trace,
    ghost_force_slice,
    gradient_mismatch,
    graph_break_in_model,
    makefx_detach,
    nonfinite_grad,
    nonfinite_term,
    norm_mismatch,
    rank_divergence,
    recompile_per_scenario,
    requires_grad_placement,
    run_failed,
    second_batch,
    shape_locked,
    stop_gradient,
    trace_eval_mode,
    unused_parameter,
)
from .common import Explained

SPECIFIC: tuple[Callable[[FlowMap], list[Finding]], ...] = (
    # A map merged over ranks (distributed.merge_maps); nothing on a map of one process.
    ddp_locally_unused.detect,
    ddp_globally_unused.detect,
    rank_divergence.detect,
    dynamo_disabled.detect,
    trace_eval_mode.detect,
    makefx_detach.detect,
    double_backward.detect,
    create_graph_detached.detect,
    donated_buffers.detect,
    create_graph_strides.detect,
    dynamo_internal.detect,
    data_dependent_trace.detect,
    backend_drops.detect,
    requires_grad_placement.detect,
    graph_break_in_model.detect,
    stop_gradient.detect,
    gradient_mismatch.detect,
    frozen_trace.detect,
    compile_unsupported.detect,
    recompile_per_scenario.detect,
    nonfinite_grad.detect,
    nonfinite_term.detect,
    second_batch.detect,
    ghost_force_slice.detect,
    norm_mismatch.detect,
    backends_differ.detect,
    shape_locked.detect,
    balance_causes.detect,
    failed_checks.detect,
    expectation_unmet.detect,
)
# In order: each reports only what the specific causes and the generic ones before it left unexplained.
GENERIC: tuple[Callable[[FlowMap, Explained], list[Finding]], ...] = (
    dead_term.detect,
    run_failed.detect,
    flow_mismatch.detect,
    gradient_mismatch.detect_unexplained,
    consistency_failed.detect,
    unused_parameter.detect,
)
