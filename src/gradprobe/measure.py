"""Measuring gradients: the two ways a step's per-scenario gradients are taken.

* ``per_term``: one forward, then one ``torch.autograd.grad`` per term on the retained graph;
  scenarios with several terms are sums of the per-term gradients. Only for eager execution: a
  compiled graph must not be differentiated several times (it can error, or with donated buffers give
  wrong values).
* ``per_scenario``: one forward and one gradient per scenario, the terms weighted by 0-dim tensors.
  For weights-mode steps and for every compiled variant.

Both return one ``Measurement`` per scenario; statuses are reduced in batches (``status.py``), a
constant number of host syncs per scenario whatever the model's size.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from .compare import cosine_and_scale, relative_errors
from .errors import GradProbeError, StepContractError
from .flowmap import RunError
from .frames import frames_of, user_frame_of
from .rng import reseed
from .scenarios import Scenario
from .status import Stacked, Stacking, read, reduce_grads
from .step import Weights, check_terms, check_total, make_weights, metrics_of

Grads = list[torch.Tensor | None]


@dataclass
class Measurement:
    """One (variant, scenario) result before it becomes flow-map cells. Gradients are not kept."""

    scenario: str
    statuses: list[str] | None = None
    norms: list[float | None] | None = None
    term_values: dict[str, float | None] = field(default_factory=dict)
    total: float | None = None
    error: RunError | None = None
    seconds: float = 0.0
    rel_errors: list[float | None] | None = None  # against the reference, when one was given
    grads: Grads | None = None  # kept only for the reference variant (one copy of the gradients)
    compiled_graphs: int | None = None  # graphs the backend compiled during this run (0 = no recompile)
    grad_cosine: float | None = None  # against the reference's gradients, all parameters at once
    grad_scale: float | None = None  # |g|_2 / |g_ref|_2
    metrics: dict[str, float | None] = field(default_factory=dict)  # what the step reports beside its loss


def run_error(stage: str, e: BaseException) -> RunError:
    """A recorded failure, with the user's frame it came from. Dynamo's own exceptions during a run
    are compile failures."""
    if stage == "forward" and _is_dynamo_error(e):
        stage = "compile"
    text = str(e).strip()
    message = text.splitlines()[0] if text else type(e).__name__
    if len(message) > 160 and ". " in message[60:]:
        message = message[: 60 + message[60:].index(". ") + 1]  # the first sentence is the message
    if "double backward" in text and "aot_autograd" in text:
        message = "torch.compile with aot_autograd does not currently support double backward"
    return RunError(stage, type(e).__name__, message[:500], user_frame_of(e), frames_of(e))


def _is_dynamo_error(e: BaseException) -> bool:
    exc = sys.modules.get("torch._dynamo.exc")  # only if dynamo was imported: no import here
    return exc is not None and isinstance(e, exc.TorchDynamoException)


def step_error_hint(e: BaseException) -> str:
    """The fix for an error the step raised that is a known mistake of the setup, not of the model:
    differentiating inputs (coordinates) that do not require grad."""
    text = str(e)
    if "does not require grad" in text and "differentiated Tensors" in text:
        return (
            "The step differentiates a tensor that does not require grad: if it is an input of the batch "
            "(a force model's coordinates), name it in the spec's differentiable_inputs=[key], so gradprobe "
            "hands the step a fresh leaf that requires grad, or call requires_grad_() on it inside the step"
        )
    return ""


def no_grad_path(what: str) -> RunError:
    return RunError(
        "backward",
        "NoGradPath",
        f"{what} does not require grad (no grad_fn): no parameter can receive its gradient",
    )


def _host_values(values: dict[str, torch.Tensor]) -> dict[str, float | None]:
    """Term values on the host with one device-to-host copy."""
    stacked = _stacked_values(values)
    if stacked is None:
        return {}
    return dict(zip(values, stacked.cpu().tolist(), strict=True))


def _stacked_values(values: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The term values as one 1-D tensor on the first value's device (float64 where a value is)."""
    if not values:
        return None
    device = next(iter(values.values())).device
    return torch.stack(
        [v.detach().reshape(()).to(device, torch.float64 if v.dtype == torch.float64 else torch.float32)
         for v in values.values()]
    )  # fmt: skip


# torch.utils.checkpoint's message when a graph holding a reentrant checkpoint is asked for .grad():
# "When use_reentrant=True, torch.utils.checkpoint is incompatible with .grad() or passing an `inputs`
# parameter to .backward()" (torch 2.13).
REENTRANT = "use_reentrant=True"
CHECKPOINT_NODE = "CheckpointFunctionBackward"  # the node a reentrant checkpoint leaves in the graph


def gradients_of(output: torch.Tensor, params: Sequence[torch.Tensor], retain_graph: bool = False) -> Grads:
    """``torch.autograd.grad(output, params, allow_unused=True)``. A graph holding a reentrant
    ``torch.utils.checkpoint`` refuses that (and ``backward(inputs=...)``): then a plain ``backward()``
    into the parameters' ``.grad``, read, and every ``.grad`` it wrote put back (the parameters', and
    those of the other leaves of the graph: the batch's tensors that require grad). ``None`` for a
    parameter with no path, as with ``allow_unused``."""
    nodes = None
    if not retain_graph:
        # The refusal comes from inside the backward, after the nodes above the checkpoint freed what they
        # saved: without retain_graph the fallback could not run again. Looked for first, then (one walk).
        nodes = _nodes(output)
    if nodes is None or not any(type(n).__name__ == CHECKPOINT_NODE for n in nodes):
        try:
            return list(torch.autograd.grad(output, params, retain_graph=retain_graph, allow_unused=True))
        except RuntimeError as e:
            if REENTRANT not in str(e):
                raise
    ids = {id(p) for p in params}
    leaves = (getattr(n, "variable", None) for n in (nodes if nodes is not None else _nodes(output)))
    others = [t for t in leaves if isinstance(t, torch.Tensor) and id(t) not in ids]
    saved = [p.grad for p in params]
    saved_others = [t.grad for t in others]
    try:
        for p in params:
            p.grad = None
        output.backward(retain_graph=retain_graph)
        return [p.grad for p in params]
    finally:
        for p, g in zip(params, saved, strict=True):
            p.grad = g
        for t, g in zip(others, saved_others, strict=True):
            t.grad = g


def _nodes(output: torch.Tensor) -> list[Any]:
    """Every node of ``output``'s autograd graph."""
    seen: set[int] = set()
    out: list[Any] = []
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        out.append(node)
        stack.extend(fn for fn, _ in node.next_functions)
    return out


def per_term(
    forward: Callable[[], object],
    params: Sequence[torch.Tensor],
    declared: Sequence[str] | None,
    scenarios_for: Callable[[Sequence[str]], Sequence[Scenario]],
    keep: bool = False,
) -> tuple[list[str], Sequence[Scenario], list[Measurement]]:
    """One forward, one gradient per term, each scenario a sum of its terms' gradients.

    Returns the term names (the declared ones, or those the step returned), the scenarios built from
    them by ``scenarios_for``, and one measurement per scenario. Each term's gradients are read (one
    copy to the host, the term values riding on the first) and released before the next backward,
    except where a scenario of several terms sums them; the sums are read together at the end.
    """
    start = time.perf_counter()
    try:
        out = forward()
    except GradProbeError:
        raise
    except Exception as e:
        if declared is None:
            where = user_frame_of(e)
            at = f" at {os.path.basename(where['file'])}:{where['line']} ({where['code']})" if where else ""
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise StepContractError(
                f"the step raised {type(e).__name__}{at} before its terms were known: {text}"
                + (f". {hint}" if (hint := step_error_hint(e)) else "")
                + ". Declare terms= in the spec to have this recorded as a failed run instead"
            ) from e
        err = run_error("forward", e)
        scenarios = scenarios_for(declared)
        return (
            list(declared),
            scenarios,
            [Measurement(s.name, error=err, seconds=time.perf_counter() - start) for s in scenarios],
        )
    terms = check_terms(out, declared)
    scenarios = scenarios_for(list(terms))
    needed = [t for t in terms if any(t in s.terms for s in scenarios)]
    multi = [s for s in scenarios if len(s.terms) > 1]
    forward_share = (time.perf_counter() - start) / max(1, len(scenarios))
    values: torch.Tensor | None = _stacked_values(terms)  # read with the first gradients
    host_values: list[float] | None = None
    stacking = Stacking(params)  # how every gradient list of this probe is held (status.py)
    sums: dict[str, Stacked | None] = {s.name: None for s in multi}
    # Per sum and unstacked slot, the term whose gradient the sum holds as it is (``_note_held``), and
    # each term's own reading: such a gradient is not reduced a second time.
    held: dict[str, list[str | None]] = {s.name: [None] * len(stacking.rest) for s in multi}
    term_reads: dict[str, tuple[list[str], list[float | None]]] = {}
    results = {s.name: Measurement(s.name) for s in scenarios}
    for k, t in enumerate(needed):
        t0 = time.perf_counter()
        grads: Grads | None = None
        error: RunError | None = None
        if not terms[t].requires_grad:
            error = no_grad_path(f"term {t!r}")
        else:
            try:
                grads = gradients_of(terms[t], params, retain_graph=k < len(needed) - 1)
            except Exception as e:
                error = run_error("backward", e)
        stacked = stacking.stack(grads) if grads is not None else None
        for s in multi:
            m, total = results[s.name], sums[s.name]
            if t not in s.terms or m.error is not None:
                continue
            if error is not None and error.type != "NoGradPath":  # a constant term adds nothing
                m.error = error
            elif stacked is not None:
                sums[s.name] = stacked if total is None else total + stacked
                _note_held(held[s.name], stacked.rest, t)
        alone = [results[s.name] for s in scenarios if s.terms == (t,)]
        if stacked is not None and alone:
            [(statuses, norms)], got = read([stacked], values)
            host_values, values = host_values or got, None
            term_reads[t] = (statuses, norms)
            for m in alone:
                m.statuses, m.norms, m.grads = list(statuses), list(norms), grads if keep else None
        for m in alone:
            m.error, m.seconds = error, (time.perf_counter() - t0) / len(alone)
        del grads, stacked
    t0 = time.perf_counter()
    for s in multi:
        m = results[s.name]
        if m.error is None and sums[s.name] is None:
            m.error = no_grad_path(f"no term of scenario {s.name!r}")
    summed = [s.name for s in multi if results[s.name].error is None]
    read_sums, got = read([_without_held(sums[n], held[n], term_reads) for n in summed], values)  # type: ignore[arg-type]
    host_values = host_values or got
    for n, (statuses, norms) in zip(summed, read_sums, strict=True):
        total, m = sums[n], results[n]
        _fill_held(statuses, norms, total.stacking.rest, held[n], term_reads)  # type: ignore[union-attr]
        m.statuses, m.norms, m.grads = statuses, norms, total.grads() if keep else None  # type: ignore[union-attr]
    for s in multi:
        results[s.name].seconds = (time.perf_counter() - t0) / len(multi)
    named = dict(zip(terms, host_values or [], strict=True))
    finite = [v for v in named.values() if v is not None]
    for m in results.values():
        m.term_values = dict(named)
        m.total = (sum(finite) if finite else None) if m.statuses is not None else None
        m.seconds += forward_share
    return list(terms), scenarios, [results[s.name] for s in scenarios]


def _note_held(held: list[str | None], rest: Sequence[torch.Tensor | None], term: str) -> None:
    """After ``term``'s gradients (``rest``: the unstacked ones) are added to a sum: per slot, the term
    whose gradient the sum holds as it is (the first one there: ``Stacked.__add__`` keeps it, not a
    copy), or "" once a second term's is added to it."""
    for j, g in enumerate(rest):
        if g is not None:
            held[j] = term if held[j] is None else ""


def _without_held(total: Stacked, held: list[str | None], reads: Mapping[str, Any]) -> Stacked:
    """The sum to reduce: without the gradients it holds as one term left them, where that term's
    own reading has their statuses and norms already (the wide model's big layers, each reached by
    one term: a pass over their values saved)."""
    rest = [None if h and h in reads else g for g, h in zip(total.rest, held, strict=True)]
    return Stacked(total.stacking, total.stacks, rest, total.present)


def _fill_held(
    statuses: list[str], norms: list[float | None], slots: list[int], held: list[str | None],
    reads: Mapping[str, tuple[list[str], list[float | None]]],
) -> None:  # fmt: skip
    """The statuses and norms ``_without_held`` left out, from the readings of the terms that gave them."""
    for i, h in zip(slots, held, strict=True):
        if h and h in reads:
            statuses[i], norms[i] = reads[h][0][i], reads[h][1][i]


WeightedCall = Callable[[Weights], object]


def per_scenario(
    call: WeightedCall,
    params: Sequence[torch.Tensor],
    scenarios: Sequence[Scenario],
    terms: Sequence[str],
    seed: int,
    *,
    keep: bool = False,
    reference: Mapping[str, Measurement] | None = None,
    counter: Any = None,
    observe: Callable[[str], AbstractContextManager[Any]] | None = None,
    isolate: bool = False,
) -> list[Measurement]:
    """One forward and one gradient per scenario; the step weighs its terms with 0-dim tensors.

    ``reference``: measurements (with gradients) to compare values with. ``counter``: the variant's
    ``CompileCounter``; a run in which no compiled graph executed ran in eager and is recorded as a
    dynamo fallback rather than measured as if compiled, and graphs compiled per run show recompiles.
    ``observe(scenario)``: a context entered around each scenario's run (dynamo's events per run).
    ``isolate``: differentiate only the scenario's own terms (their values as the run returns them),
    never the switched-off ones multiplied by 0: a term whose backward raises (a double backward
    through compiled code) or gives NaN then cannot spoil the scenarios that do not use it. For
    terms-mode steps, whose weights are exactly 1 and 0, the gradients are the same.
    """
    like = params[0]
    results = []
    for s in scenarios:
        t0 = time.perf_counter()
        reseed(seed)
        m = Measurement(s.name)
        executions, graphs = (counter.executions, counter.graphs) if counter is not None else (0, 0)
        with observe(s.name) if observe is not None else contextlib.nullcontext():
            _run_scenario(
                m, call, params, s, terms, like, counter, executions, graphs, reference, keep, isolate
            )
        m.seconds = time.perf_counter() - t0
        results.append(m)
    return results


def isolated(total: torch.Tensor, values: Mapping[str, torch.Tensor], on: Sequence[str]) -> torch.Tensor:
    """The sum of the switched-on terms' values, or ``total`` when the run did not return them all."""
    if not on or any(t not in values for t in on):
        return total
    out = values[on[0]]
    for t in on[1:]:
        out = out + values[t]
    return out.reshape(total.shape)


def _run_scenario(
    m: Measurement,
    call: WeightedCall,
    params: Sequence[torch.Tensor],
    s: Scenario,
    terms: Sequence[str],
    like: torch.Tensor,
    counter: Any,
    executions: int,
    graphs: int,
    reference: Mapping[str, Measurement] | None,
    keep: bool,
    isolate: bool = False,
) -> None:
    """One forward and one gradient of one scenario into ``m``; failures are recorded, not raised."""
    try:
        out = call(make_weights(terms, s.terms, like))
    except GradProbeError:
        raise
    except Exception as e:
        m.error = run_error("forward", e)
        return
    total, values = check_total(out, terms)
    host = _host_values({"__total__": total, **values})
    m.total = host.pop("__total__")
    m.term_values = host
    metrics = {k: v for k, v in metrics_of(out).items() if isinstance(v, torch.Tensor) and v.numel() == 1}
    if metrics:
        m.metrics = _host_values(metrics)
    if counter is not None:
        m.compiled_graphs = counter.graphs - graphs
    if counter is not None and counter.executions == executions:
        m.error = RunError(
            "compile",
            "DynamoFallback",
            getattr(counter, "fallback_message", None)
            or "no compiled graph ran: the path's compile counter saw no execution of its compiled code in "
            "this run, so this run would measure eager code, not the compiled path",
        )
        return
    target = isolated(total, values, s.terms) if isolate else total
    if not target.requires_grad:
        m.error = no_grad_path(f"the total loss of scenario {s.name!r}")
        return
    try:
        grads = gradients_of(target, params)
    except Exception as e:
        m.error = run_error("backward", e)
        return
    m.statuses, m.norms = reduce_grads(grads)
    ref = reference.get(s.name) if reference is not None else None
    if ref is not None and ref.grads is not None and ref.norms is not None:
        m.rel_errors = relative_errors(grads, ref.grads, ref.norms)
        m.grad_cosine, m.grad_scale = cosine_and_scale(grads, ref.grads)
    if keep:
        m.grads = grads
