"""Measuring gradients: the two ways a step's per-scenario gradients are taken.

* ``per_term``: one forward, then one ``autograd.grad`` per term on the retained graph; scenarios with
  several terms are sums of the per-term gradients. Only for eager execution: a compiled graph must
  not be differentiated several times (it can error, or with donated buffers give wrong values).
* ``per_scenario``: one forward and one gradient per scenario, the terms weighted by 0-dim tensors.
  For weights-mode steps and for every compiled variant.

Both return one ``Measurement`` per scenario; statuses are reduced in batches (``status.py``).
"""

from __future__ import annotations

import contextlib
import operator
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from .compare import allclose_excess, cosine_and_scale, relative_errors
from .errors import GradProbeError, StepContractError
from .flowmap import RunError
from .frames import frames_of, user_frame_of
from .scenarios import Scenario
from .state import reseed
from .status import Launched, Pending, Plan, launch, plan_for, read_planned, reduce_grads
from .status import read as read_reductions
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
    excess: list[float | None] | None = None  # max(|g - g_ref| - rtol |g_ref|) per parameter (consistency)
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


def no_grad_path(what: str) -> RunError:
    return RunError(
        "backward",
        "NoGradPath",
        f"{what} does not require grad (no grad_fn): no parameter can receive its gradient. Is the model "
        "in eval mode (create_graph=self.training), or is it computed under no_grad / detach?",
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
    tensors = list(values.values())
    if (
        len(dtypes := set(map(_DTYPE, tensors))) == 1
        and dtypes <= _WIDE
        and set(map(torch.Tensor.dim, tensors)) == {0}
    ):
        # The usual case: scalar losses of one dtype, float32 or float64, stacked as they are (a
        # stack needs one device: a loss on another raises, and is converted below).
        try:
            return torch.stack(list(map(torch.Tensor.detach, tensors)))
        except RuntimeError:
            pass
    device = tensors[0].device
    return torch.stack(
        [
            v.detach().reshape(()).to(torch.float64 if v.dtype == torch.float64 else torch.float32).to(device)
            for v in values.values()
        ]
    )


_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
_WIDE = frozenset((torch.float32, torch.float64))


def per_term(
    forward: Callable[[], object],
    params: Sequence[torch.Tensor],
    declared: Sequence[str] | None,
    scenarios_for: Callable[[Sequence[str]], Sequence[Scenario]],
    keep: bool = False,
) -> tuple[list[str], Sequence[Scenario], list[Measurement]]:
    """One forward, one gradient per term, each scenario a sum of its terms' gradients.

    Returns the term names (the declared ones, or those the step returned), the scenarios built from
    them by ``scenarios_for``, and one measurement per scenario (``_Reductions``: one host copy per
    scenario, the term values with the first).
    """
    start = time.perf_counter()
    try:
        out = forward()
    except GradProbeError:
        raise
    except Exception as e:
        if declared is None:
            raise StepContractError(
                f"the step raised {type(e).__name__} before its terms were known: {e}. Declare terms= in "
                "the spec to have this recorded as a failed run instead"
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
    # A few gradients (a small model) are all held and reduced after the last backward, read at once:
    # the backward passes run back to back, as in a plain training step (gradprobe's bookkeeping in
    # between slows the next one down: its caches go cold), and there is one copy to the host per
    # probe instead of one per scenario. More are reduced and read term by term, so that each term's
    # are released before the next backward (see _Reductions).
    hold = len(params) <= HELD_TENSORS
    forward_seconds = time.perf_counter() - start
    plan: Plan | None = None
    reductions: _Reductions | None = None
    sums: dict[str, _Sum] = {}
    acc_error: dict[str, RunError | None] = {s.name: None for s in multi}
    results: dict[str, Measurement] = {}
    by_term: dict[str, Measurement] = {}

    def take(t: str, grads: Grads | None, error: RunError | None, seconds: float) -> None:
        """One term's gradients into its own scenario and the sums of the scenarios it is part of."""
        nonlocal plan, reductions
        if reductions is None:  # set up at the first term: after the backward passes when held
            plan = plan_for(params) if needed else None
            reductions = _Reductions(
                list(terms), _stacked_values(terms), keep, plan, hold and plan is not None
            )
            sums.update((s.name, _Sum(plan)) for s in multi)
        t0 = time.perf_counter() - seconds  # a measurement's seconds count its backward
        launched = plan.take(grads) if plan is not None and grads is not None else None
        for s in scenarios:
            if s.terms == (t,):
                results[s.name] = by_term[t] = reductions.add(s.name, grads, error, t0, launched=launched)
        for s in multi:
            if t not in s.terms:
                continue
            if error is not None and error.type != "NoGradPath":
                acc_error[s.name] = acc_error[s.name] or error
            elif grads is not None:
                sums[s.name].add(grads, launched, t)

    held: list[tuple[str, Grads | None, RunError | None, float]] = []
    for k, t in enumerate(needed):
        t0 = time.perf_counter()
        grads: Grads | None = None
        error: RunError | None = None
        if not terms[t].requires_grad:
            error = no_grad_path(f"term {t!r}")
        else:
            try:
                grads = list(term_grads(terms[t], params, retain_graph=k < len(needed) - 1))
            except Exception as e:
                error = run_error("backward", e)
        if hold:
            held.append((t, grads, error, time.perf_counter() - t0))
        else:
            take(t, grads, error, time.perf_counter() - t0)
        del grads
    for item in held:
        take(*item)
    held.clear()
    if reductions is None:  # no term to differentiate
        reductions = _Reductions(list(terms), _stacked_values(terms), keep)
    for s in multi:
        t0 = time.perf_counter()
        error = acc_error[s.name]
        total = sums.pop(s.name)
        if error is None and total.empty:
            error = no_grad_path(f"no term of scenario {s.name!r}")
        if error is not None:
            results[s.name] = reductions.add(s.name, None, error, t0)
        else:
            results[s.name] = total.measure(reductions, s.name, t0, by_term)
    reductions.read()
    for m in results.values():
        m.seconds += forward_seconds / len(scenarios)
    return list(terms), scenarios, [results[s.name] for s in scenarios]


# torch.autograd.grad as torch ships it, and the engine call it ends in (torch 2.2 and later).
_TORCH_GRAD = torch.autograd.grad
_ENGINE_RUN_BACKWARD = getattr(torch.autograd.graph, "_engine_run_backward", None)
_has_torch_function = torch._C._has_torch_function


def term_grads(term: torch.Tensor, params: Sequence[torch.Tensor], retain_graph: bool) -> Sequence[Any]:
    """``torch.autograd.grad(term, params, retain_graph=retain_graph, allow_unused=True)``.

    Where that call would do nothing but prepare its arguments and call autograd's engine (a plain
    real scalar tensor, no ``__torch_function__`` on it or the parameters, no function mode, and
    ``torch.autograd.grad`` itself not replaced by a user or a recorder), the engine is called
    directly with what ``grad`` would pass it (a grad_output of ones like the term): ``grad``'s
    argument checks cost a Python call per parameter and an import per call, about a tenth of a
    small model's backward, three times per probe."""
    if (
        _ENGINE_RUN_BACKWARD is None
        or torch.autograd.grad is not _TORCH_GRAD
        or type(term) is not torch.Tensor
        or term.is_complex()
        or term.is_nested
        or _has_torch_function((term, *params))
    ):
        return torch.autograd.grad(term, params, retain_graph=retain_graph, allow_unused=True)
    ones = torch.ones_like(term, memory_format=torch.preserve_format)
    return _ENGINE_RUN_BACKWARD(
        (term,), (ones,), retain_graph, False, tuple(params), True, accumulate_grad=False
    )


class _Sum:
    """A scenario of several terms: the sum of its terms' gradients, built term by term.

    With a ``Plan``, the small gradients are summed as the plan's stacked groups (one add per group;
    the stacks are each term's own copies, never written), the others one by one as ``_add`` does;
    a term whose gradients the plan could not launch (a sparse one) turns the sum into ``_add``'s
    per-parameter list from there on. ``who[i]``: the one term whose gradient the sum holds
    unchanged at ``i`` (``_SUMMED`` once two were added): its status and norm are that term's own
    (``_known``), not reduced again."""

    def __init__(self, plan: Plan | None) -> None:
        self.plan = plan
        self.stacks: list[torch.Tensor | None] = [None] * len(plan.stacks) if plan is not None else []
        self.present: list[bool] | None = None  # any term's gradient, per parameter
        self.acc: Grads | None = None  # per parameter (no plan), or per plan.singles
        self.who: list[str | None] = [None] * len(plan.singles) if plan is not None else []
        self.empty = True

    def add(self, grads: Grads, launched: Launched | None, term: str) -> None:
        self.empty = False
        if self.plan is not None and launched is None:  # unplanned from here on: per parameter
            self.acc, self.who = self.per_parameter(), self.who_per_parameter()
            self.plan = None
        plan = self.plan
        if plan is None:
            if len(self.who) != len(grads):
                self.who = [None] * len(grads)
            self.acc = _add(self.acc, grads, self.who, term)
            return
        assert launched is not None
        present = launched.present
        self.present = present if self.present is None else list(map(operator.or_, self.present, present))
        for j, stacked in enumerate(launched.stacks):
            if stacked is not None:
                now = self.stacks[j]
                self.stacks[j] = stacked if now is None else now + stacked
        if plan.single_getter is not None:
            self.acc = _add(self.acc, list(plan.single_getter(grads)), self.who, term)

    def per_parameter(self) -> Grads | None:
        """The sum so far, one tensor (or None) per parameter."""
        plan = self.plan
        if plan is None:
            return self.acc
        if self.present is None:
            return None
        out: Grads = [None] * plan.size
        for (idx, _, _), stacked in zip(plan.stacks, self.stacks, strict=True):
            if stacked is not None:
                for i, g in zip(idx, stacked.unbind(0), strict=True):
                    out[i] = g
        for i, g in zip(plan.singles, self.acc or (), strict=True):
            out[i] = g
        return [g if p else None for g, p in zip(out, self.present, strict=True)]

    def who_per_parameter(self) -> list[str | None]:
        plan = self.plan
        if plan is None:
            return self.who
        who: list[str | None] = [_SUMMED] * plan.size
        for i, w in zip(plan.singles, self.who, strict=True):
            who[i] = w
        return who

    def measure(
        self, reductions: _Reductions, name: str, t0: float, by_term: Mapping[str, Measurement]
    ) -> Measurement:
        known = _known(self.who, by_term)
        plan = self.plan
        if plan is None:
            return reductions.add(name, self.acc, None, t0, known)
        # The singles whose status and norm another measurement already has (``known``: the sum holds
        # one term's gradient unchanged there) are not reduced again.
        singles = [None if j in known else g for j, g in enumerate(self.acc or [None] * len(plan.singles))]
        assert self.present is not None
        launched = Launched(self.per_parameter, self.present, all(self.present), self.stacks, singles)
        # ``known`` indexes plan.singles: in parameter order for the measurement.
        return reductions.add(
            name, None, None, t0, {plan.singles[j]: m for j, m in known.items()}, launched=launched
        )


HELD_TENSORS = 64  # parameter tensors up to which every scenario is read at once (per_term)


def _set_read(
    items: Sequence[tuple[Measurement, Any, dict[int, Measurement]]],
    results: Sequence[tuple[list[str], list[float | None]]],
) -> None:
    """Each measurement's statuses and norms as read, those ``known`` taken from the measurement that
    has them (read before: added earlier)."""
    for (m, _, known), (statuses, norms) in zip(items, results, strict=True):
        for i, other in known.items():
            statuses[i], norms[i] = other.statuses[i], other.norms[i]  # type: ignore[index]
        m.statuses, m.norms = statuses, norms


class _Reductions:
    """Measurements whose gradients are reduced as they come, one copy to the host per scenario
    (per device), the term values riding on the first: the syncs per scenario do not depend on the
    model. Each term's gradients are read, then released, before the next backward: holding every
    term's (to read them all at once) would hold tens of thousands of tensors through the next
    backward at 8,192 parameter tensors, enough to set off a full garbage collection there (0.2 s),
    and hold more memory. With ``hold`` (a few parameter tensors, ``HELD_TENSORS``), the gradients a
    ``Plan`` took are held and read all at once by ``read()``: one copy to the host per probe."""

    def __init__(
        self,
        terms: list[str],
        values: torch.Tensor | None,
        keep: bool,
        plan: Plan | None = None,
        hold: bool = False,
    ) -> None:
        self.terms = terms
        self.values = values  # read with the first batch of norms
        self.keep = keep
        self.plan = plan
        self.hold = hold
        self.host_values: dict[str, float | None] | None = None
        self.pending: list[tuple[Measurement, Pending, dict[int, Measurement]]] = []
        self.planned: list[tuple[Measurement, Launched, dict[int, Measurement]]] = []
        self.measurements: list[Measurement] = []

    def add(
        self,
        name: str,
        grads: Grads | None,
        error: RunError | None,
        t0: float,
        known: dict[int, Measurement] | None = None,
        launched: Launched | None = None,
    ) -> Measurement:
        """A measurement of ``grads`` (``known``: parameters whose status and norm are another
        pending or read measurement's, taken from it instead of reduced again; ``launched``: the
        plan's take of them)."""
        m = Measurement(name, error=error)
        self.measurements.append(m)
        if launched is not None and error is None:
            if self.keep:
                m.grads = list(launched.gradients())
            self.planned.append((m, launched, known or {}))
        elif grads is not None and error is None:
            if self.keep:
                m.grads = grads
            known = known or {}
            p = launch([None if i in known else g for i, g in enumerate(grads)] if known else grads)
            self.pending.append((m, p, known))
        m.seconds = time.perf_counter() - t0
        if not (self.hold and launched is not None):
            self.read()
        return m

    def read(self) -> None:
        """Statuses and norms of every pending measurement; the term values and totals of all."""
        t0 = time.perf_counter()
        read = [m for m, _, _ in self.planned] + [m for m, _, _ in self.pending]
        if self.planned:
            assert self.plan is not None
            # The term values ride on the copy to the host where they are on the norms' device.
            extra = (
                self.values
                if self.values is not None and self.values.device == self.plan.like.device
                else None
            )
            results, values = read_planned(self.plan, [x for _, x, _ in self.planned], extra)
            if extra is not None:
                self._values_read(values)
            _set_read(self.planned, results)
            self.planned.clear()
        if self.pending or self.host_values is None:
            results, values = read_reductions([p for _, p, _ in self.pending], self.values)
            if self.host_values is None:
                self._values_read(values)
            _set_read(self.pending, results)
            self.pending.clear()
        share = (time.perf_counter() - t0) / max(1, len(read))
        for m in read:
            m.seconds += share
        assert self.host_values is not None
        finite = [v for v in self.host_values.values() if v is not None]
        for m in self.measurements:
            m.term_values = dict(self.host_values)
            if m.statuses is not None:
                m.total = sum(finite) if finite else None

    def _values_read(self, values: list[float] | None) -> None:
        self.host_values = dict(zip(self.terms, values or [], strict=True))
        self.values = None


def _add(acc: Grads | None, grads: Grads, who: list[str | None], term: str) -> Grads:
    """``acc + grads`` where None is "no gradient" (None + g = g), never in place; ``who[i]`` records
    which term the sum at ``i`` holds unchanged (``term`` where it is the first, ``_SUMMED`` once a
    second one is added), in the same pass.

    A gradient entering an empty slot is held as it is, not copied: autograd may return a tensor
    someone else holds (a custom ``backward`` that hands back a saved tensor of the user's batch, the
    same tensor for two parameters, an expanded view), so nothing is ever written into a slot; a
    second gradient makes a new tensor (one batched out-of-place add for the dense pairs). Most
    parameters are reached by one term: their slots cost nothing (no copy of thousands of
    gradients). A sparse gradient (``nn.Embedding(sparse=True)``) or a mix of layouts is added on its
    own.
    """
    if acc is None:
        for i, g in enumerate(grads):
            if g is not None:
                who[i] = term
        return list(grads)
    dense: list[int] = []
    strided = torch.strided
    for i, g in enumerate(grads):
        if g is None:
            continue
        a = acc[i]
        if a is None:
            acc[i] = g
            who[i] = term
            continue
        who[i] = _SUMMED
        if a.layout == strided and g.layout == strided:
            dense.append(i)
        else:
            # Sparse + sparse, or a mix: a dense tensor goes first (sparse + dense has no kernel;
            # dense + sparse has).
            acc[i] = g + a if g.layout == strided else a + g
    if dense:
        sums = torch._foreach_add([acc[i] for i in dense], [grads[i] for i in dense])  # type: ignore[misc]
        for i, total in zip(dense, sums, strict=True):
            acc[i] = total
    return acc


_SUMMED = "\0summed"  # not a term name: a term name is a str the step returned, never this one


def _known(alone: list[str | None], by_term: Mapping[str, Measurement]) -> dict[int, Measurement]:
    """Parameters whose status and norm a sum shares with one term: where only that term reached the
    parameter, the sum's gradient is that term's gradient (the same values), reduced on its own."""
    known: dict[int, Measurement] = {}
    for i, t in enumerate(alone):
        m = by_term.get(t) if t is not None and t != _SUMMED else None
        if m is not None and m.error is None:
            known[i] = m
    return known


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
    consistency_rtol: float = 1e-10,
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
            _run_scenario(m, call, params, s, terms, like, counter, executions, graphs, reference, keep,
                          consistency_rtol, isolate)  # fmt: skip
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
    consistency_rtol: float,
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
            or "no compiled graph ran: dynamo ran this step in eager (recompile limit reached, or the "
            "frame was skipped), so this run would measure eager, not the compiled path",
        )
        return
    target = isolated(total, values, s.terms) if isolate else total
    if not target.requires_grad:
        m.error = no_grad_path(f"the total loss of scenario {s.name!r}")
        return
    try:
        grads = list(torch.autograd.grad(target, params, allow_unused=True))
    except Exception as e:
        m.error = run_error("backward", e)
        return
    m.statuses, m.norms = reduce_grads(grads)
    ref = reference.get(s.name) if reference is not None else None
    if ref is not None and ref.grads is not None and ref.norms is not None:
        m.rel_errors = relative_errors(grads, ref.grads, ref.norms)
        m.excess = allclose_excess(grads, ref.grads, consistency_rtol)
        m.grad_cosine, m.grad_scale = cosine_and_scale(grads, ref.grads)
    if keep:
        m.grads = grads
