"""``probe()``: the one entry point. Spec in, flow map out; the user's model is left as found."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
from torch.distributions import Distribution

from . import __version__
from .balance import balance_report
from .batch import batch_tensors, check_devices, check_not_inference, with_differentiable_inputs
from .build import Built, VariantContext, build
from .checks import consistency_report, physics_check, training_check
from .compare import consistency_tolerance, judge, loosest, precision, tolerance, verdict
from .declarations import check_against, normalized_expect
from .diagnose import diagnose
from .errors import GradProbeError, SpecError, did_you_mean
from .evidence import compiler_passes
from .evidence.anomaly import with_double_backward_frames
from .evidence.dynamo_events import Watch
from .evidence.graphlint import lint
from .flowmap import Cell, FlowMap, ParameterInfo, Run, ScenarioInfo, VariantInfo
from .measure import Measurement, per_scenario, per_term
from .progress import reporting, stage
from .quiet import quietly
from .rng import reseed
from .scenarios import Scenario, resolve_scenarios
from .spec import ProbeSpec, check_values, resolve_model
from .state import contained, isolated_settings, preserved
from .step import make_weights
from .variants import VariantSpec, parse_variants
from .walk import Tree, walk


def probe(
    model: torch.nn.Module | ProbeSpec | Any,
    step: Any = None,
    batch: Any = None,
    *,
    variants: str | Sequence[str | VariantSpec] | None = None,
    reference: str | None = None,
    diagnose: bool = False,
    checks: Sequence[str] = (),
    progress: bool = True,
    compiler_bisect: bool = False,
    fail_on: str = "error",
    **spec_fields: Any,
) -> FlowMap:
    """Measure which parameters each loss term reaches, alone and all together, in each variant.

    Call it with a spec, ``probe(spec, variants=...)``, or with the spec's fields,
    ``probe(model, step, batch, terms=[...])``. ``variants`` is a comma-separated spelling such as
    ``"eager,make_fx,compile:aot_eager"`` (default: the spec's ``variants``, else ``"eager"``); every
    variant's gradients are compared value by value with the ``reference`` variant (default: the first).
    ``diagnose=True`` also bisects each failing variant's knobs and locates where chains break in the
    model (extra traces and compiles), so findings can name the cause, the place and a verified fix.
    ``checks`` adds verification: ``"physics"`` (forces and virial against finite differences of
    ``spec.energy_fn``), ``"shapes"`` (traced variants on ``spec.other_shapes_batch``), ``"training"``
    (a few optimizer steps per term on a copy); value consistency between variants is always checked.
    ``progress``: show on stderr which variant and stage is running once the probe has run a second (a
    live line on a terminal, plain lines otherwise); ``False`` keeps it silent.
    ``compiler_bisect`` (with ``diagnose``): when the backend ladder ends at ``aot_eager_decomp_partition``
    or ``inductor``, hand the path to torch's ``CompilerBisector`` to name the pass, decomposition or
    lowering (one rebuild and compile per trial, caches off: opt-in; its trials and time are reported).
    ``fail_on``: ``"error"`` (default) or ``"warning"``: which findings make ``fm.exit_code`` 1 (a CI job
    that wants every intended stop-gradient declared in ``notes`` fails on warnings).
    Returns the flow map; the model's parameters, ``.grad``, ``requires_grad`` flags, train/eval
    modes, buffers and RNG state are as they were.

    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> def step(m, b):
    ...     y = m(b)
    ...     return {"fit": y.pow(2).mean(), "bias_reg": m.bias.abs().sum()}
    >>> fm = probe(model, step, torch.ones(4, 2))
    >>> fm.count("eager", "bias_reg only")
    (1, 2)
    """
    if isinstance(checks, str):
        raise SpecError(
            f"checks must be a list of names, got the string {checks!r}: write checks=[{checks!r}] "
            f"(or checks={[c.strip() for c in checks.split(',') if c.strip()]!r})"
        )
    if isinstance(model, ProbeSpec):
        if step is not None or batch is not None or spec_fields:
            raise SpecError("probe(spec) takes no other spec fields: use dataclasses.replace(spec, ...)")
        spec = model
    else:
        spec = ProbeSpec(model=model, step=step, batch=batch, **spec_fields)
    if fail_on not in ("error", "warning"):
        raise SpecError(f"fail_on must be 'error' or 'warning', got {fail_on!r}")
    with reporting(progress), compiler_passes.enabled(compiler_bisect):
        fm = run_probe(
            spec, parse_variants(variants or spec.variants or "eager"), reference, diagnose, tuple(checks)
        )
    return fm if fail_on == "error" else msgspec.structs.replace(fm, fail_on=fail_on)


@dataclass
class _Measured:
    variant: VariantSpec
    info: VariantInfo
    results: list[Measurement]
    # The precision its comparison with the reference is judged at (``compare.LEVELS``): its autocast
    # knob, or what was observed of it or of the reference (``evidence.precision``).
    computes_in: str = "off"


CHECKS = ("physics", "shapes", "training", "balance", "gradients")


def _is_plain_eager(v: VariantSpec) -> bool:
    return v.capture == "eager" and v.backend is None and not v.knobs


def run_probe(
    spec: ProbeSpec,
    variants: Sequence[VariantSpec],
    reference: str | None = None,
    diagnose_: bool = False,
    checks: tuple[str, ...] = (),
) -> FlowMap:
    # Called inside torch.inference_mode(), autograd would record nothing (enable_grad does not leave
    # inference mode): the probe leaves it, and the caller's mode is back on return.
    # In a copy of the context: config values a step or a variant sets are gone at the end (state.py).
    # What torch says meanwhile (dynamo's warnings) is summarised in the flow map, not printed (quiet.py).
    with torch.inference_mode(False):
        fm, said = quietly(contained, lambda: _run_probe(spec, variants, reference, diagnose_, checks))
    return msgspec.structs.replace(fm, warnings=(*fm.warnings, *said)) if said else fm


@dataclass
class _Probe:
    """One probe's working state, handed from phase to phase: what ``_prepare`` resolved, then what
    each phase adds (measurements, builds, check results, evidence)."""

    spec: ProbeSpec
    model: torch.nn.Module
    tree: Tree
    trainable: list[tuple[str, torch.nn.Parameter]]
    mode: str
    variants: list[VariantSpec]  # the reference first: the others are compared with its gradients
    reference: str
    terms: list[str]  # in terms mode without declared terms: from the eager call (``_measure_variants``)
    scenarios: Sequence[Scenario]
    diagnose: bool
    checks: tuple[str, ...]
    model_training: bool
    params: list[torch.nn.Parameter] = field(init=False)  # the trainable tensors, in ``trainable``'s order
    dtype: str = field(
        init=False
    )  # the probe's precision: the first trainable parameter's (compare.precision)
    batch: Any = None  # the spec's batch with fresh differentiable inputs, inside ``preserved``
    measured: list[_Measured] = field(default_factory=list)
    builds: dict[str, Built] = field(default_factory=dict)
    watches: dict[str, Watch] = field(default_factory=dict)
    ref_results: dict[str, Measurement] = field(default_factory=dict)
    checked: dict[str, Any] = field(default_factory=dict)  # the flow map's ``checks``
    evidence: dict[str, Any] = field(default_factory=dict)
    bisections: list[dict[str, Any]] = field(default_factory=list)
    breaks: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.params = [p for _, p in self.trainable]
        self.dtype = precision(self.params[0])


def _run_probe(
    spec: ProbeSpec,
    variants: Sequence[VariantSpec],
    reference: str | None = None,
    diagnose_: bool = False,
    checks: tuple[str, ...] = (),
) -> FlowMap:
    state = _prepare(spec, variants, reference, diagnose_, checks)
    with (
        preserved(state.model, [t for _, t in state.tree.parameters], state.tree.modules, contained=True),
        torch.enable_grad(),
    ):
        state.batch = with_differentiable_inputs(spec.batch, spec.differentiable_inputs)
        _measure_variants(state)
        _observe_precisions(state)
        _second_batch(state)
        _run_checks(state)
        _gather_evidence(state)
        state.ref_results.clear()  # drop the kept gradients
        for m in state.measured:
            for r in m.results:
                r.grads = None
    fm = _flow_map(state)
    # The findings are the map's own reading of itself: a copy of the map with them.
    return msgspec.structs.replace(fm, findings=tuple(diagnose(fm)))


def _prepare(
    spec: ProbeSpec,
    variants: Sequence[VariantSpec],
    reference: str | None,
    diagnose_: bool,
    checks: tuple[str, ...],
) -> _Probe:
    """The model resolved and walked once; its values, the batch, the devices, the terms, the scenarios,
    the declarations and the checks asked for validated before anything runs."""
    model = resolve_model(spec, check=False)
    try:
        tree = walk(model)  # one walk of the modules: parameters, buffers and modules for what follows
    except RecursionError:
        raise SpecError(
            f"the model is nested deeper than Python's recursion limit ({sys.getrecursionlimit()}): torch's "
            "own walk of its modules (named_modules) cannot list them. Raise the limit first "
            "(sys.setrecursionlimit), or flatten the nesting"
        ) from None
    named = tree.parameters
    check_values(model, named, tree.buffers)
    in_batch = batch_tensors(spec.batch)  # one walk of the batch for both checks
    check_not_inference(spec.batch, named, in_batch)
    trainable = [x for x in named if x[1].requires_grad]  # the same pairs: no new tuple each
    if not trainable:
        raise SpecError(
            f"the model ({type(model).__name__}) has no trainable parameters "
            f"({len(named)} parameters, none with requires_grad=True): nothing can receive a gradient"
        )
    check_devices(spec.batch, model, (p for _, p in named), in_batch)
    mode = spec.resolved_mode()
    if mode == "weights" and spec.terms is None:
        raise SpecError("a weights-mode step needs terms=[...]: the names of the weights it takes")
    ref_name = reference or variants[0].name
    if ref_name not in [v.name for v in variants]:
        raise SpecError(
            f"reference variant {ref_name!r} is not among the variants: {[v.name for v in variants]}"
        )
    # The reference is measured first: the others are compared with its gradients.
    ordered = sorted(variants, key=lambda v: v.name != ref_name)
    if spec.terms is None and not (mode == "terms" and _is_plain_eager(ordered[0])):
        raise SpecError("declare terms=[...] in the spec: the reference variant is not plain eager, so the "
                        "term names cannot be taken from an eager call")  # fmt: skip
    terms: list[str] = list(spec.terms) if spec.terms is not None else []
    scenarios: Sequence[Scenario] = resolve_scenarios(spec.scenarios, terms) if terms else ()
    if scenarios and spec.expect is not None:  # a misspelt declaration fails before anything is compiled
        check_against(normalized_expect(spec.expect), [s.name for s in scenarios], [n for n, _ in trainable])
    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        raise SpecError(
            f"unknown check {unknown[0]!r}{did_you_mean(unknown[0], CHECKS)}; checks are: {', '.join(CHECKS)}"
        )
    return _Probe(
        spec=spec,
        model=model,
        tree=tree,
        trainable=trainable,
        mode=mode,
        variants=ordered,
        reference=ref_name,
        terms=terms,
        scenarios=scenarios,
        diagnose=diagnose_,
        checks=checks,
        model_training=model.training,
    )


# The environment fact recorded when a probe that may compile turned torch.distributions' argument
# validation off for its paths (``_measure_variants``).
VALIDATION_OFF = "distribution_validation_off"


def _measure_variants(state: _Probe) -> None:
    """Every variant measured in turn, the reference first; each variant built once."""
    # The reference's gradients are kept (one copy per scenario) only when something reads them:
    # another variant, the consistency and balance checks, or the diagnosis.
    keep_ref = len(state.variants) > 1 or state.diagnose or "balance" in state.checks
    # Nothing but the flow map follows a lone variant: preserved() puts the settings back.
    alone = len(state.variants) == 1 and not state.diagnose and not state.checks
    if any(not _is_plain_eager(v) for v in state.variants):
        # Loaded before the reference runs, which a path will load anyway: the autograd.grad calls of
        # every window, the reference's too, are recorded (evidence.grad_calls needs it loaded).
        import torch._dynamo  # noqa: F401
    if any(v.compiled or v.capture == "user" for v in state.variants) and Distribution._validate_args:
        # torch.compile's first use in a process turns torch.distributions' argument validation off for
        # good (dynamo's TorchPatcher.patch, once per process). Measured on 2.13: make_fx of a step that
        # builds a Categorical fails on validation's data-dependent check before it and traces after, so
        # a path measured, or a bisection trial run, after the first compile would see other code than
        # one before. Every path of a probe that may compile runs as in a process that compiles: off,
        # the reference too; preserved() puts the user's value back.
        Distribution.set_default_validate_args(False)
        state.evidence.setdefault("environment", {})[VALIDATION_OFF] = True
    for variant in state.variants:
        state.measured.append(
            _measure(state, variant, keep=variant.name == state.reference and keep_ref, alone=alone)
        )


def _measure(state: _Probe, variant: VariantSpec, keep: bool, alone: bool) -> _Measured:
    """One variant: plain eager in terms mode (one forward, a gradient per term; the terms and scenarios
    come from this call when the spec declares none), plain eager in weights mode, or built (traced,
    compiled, a user's path) and run once per scenario."""
    spec, model, params, terms, batch = state.spec, state.model, state.params, state.terms, state.batch
    is_ref = variant.name == state.reference
    reference = None if is_ref else state.ref_results
    start = time.perf_counter()
    breaks_before = _graph_breaks() if variant.compiled else 0
    built: Built | None = None
    watch = state.watches[variant.name] = Watch()
    with stage(variant.name), watch, _isolated(variant, alone):
        if _is_plain_eager(variant) and state.mode == "terms":
            reseed(spec.seed)
            with watch.window("the eager step"), stage("one forward, a gradient per term"):
                state.terms, state.scenarios, results = per_term(
                    lambda b=batch: spec.step(model, b),
                    params,
                    spec.terms,
                    lambda ts: resolve_scenarios(spec.scenarios, ts),
                    keep=keep,
                )
            if not is_ref:
                results = _compare_per_term(results, state.ref_results)
        elif _is_plain_eager(variant):
            results = per_scenario(
                lambda w, b=batch: spec.step(model, b, w),
                params, state.scenarios, terms, spec.seed, keep=keep,
                reference=reference, observe=_observed(watch, state.scenarios),
            )  # fmt: skip
        else:
            ctx = VariantContext(
                model,
                spec.step,
                state.mode,
                terms,
                batch,
                make_weights(terms, terms, params[0]),
                seed=spec.seed,
            )
            with watch.window("build"), stage("build"):
                built = build(variant, ctx)
            state.builds[variant.name] = built
            if built.error is not None:
                results = [Measurement(s.name, error=built.error) for s in state.scenarios]
            else:
                results = per_scenario(
                    lambda w, run=built.run, b=batch: run(b, w),
                    params, state.scenarios, terms, spec.seed, keep=keep,
                    reference=reference,
                    counter=built.counter,
                    observe=_observed(watch, state.scenarios),
                    isolate=state.mode == "terms",
                )  # fmt: skip
                # A double backward raised in autograd's engine names no user frame: anomaly
                # mode's forward trace of one failing scenario gives it (no recompile).
                results = with_double_backward_frames(
                    results,
                    lambda name, run=built.run, b=batch, ss=state.scenarios, ts=terms: per_scenario(
                        lambda w: run(b, w), params, [s for s in ss if s.name == name],
                        ts, spec.seed, isolate=state.mode == "terms",
                    ),
                )  # fmt: skip
    if is_ref:
        state.ref_results = {m.scenario: m for m in results}
    info = VariantInfo(
        variant.name,
        dict(variant.knobs),
        built.error if built is not None else None,
        _compiles(results) if built is not None and built.counter is not None else None,
        time.perf_counter() - start,
        variant.capture,
        variant.backend,
        built.counter.graphs if built is not None and built.counter is not None else None,
        _graph_breaks() - breaks_before if variant.compiled else None,
        graph=_lint(built, len(params)),
    )
    knob = variant.knobs.get("autocast", "off") if variant.capture != "user" else "off"
    return _Measured(variant, info, results, knob)


def _observe_precisions(state: _Probe) -> None:
    """Where a path's gradients differ from the reference's beyond the tolerance of its knob, the
    precision the reference and the user's own path compute in, observed (``evidence.precision``): a
    path in bfloat16 (autocast in a trainer or in the step) is then compared at bfloat16's tolerance.
    Nothing runs where every comparison already passes: observing can only loosen a tolerance."""
    ref = next((x for x in state.measured if x.info.name == state.reference), None)
    seen: dict[str, dict[str, Any] | None] = {}

    def observed(x: _Measured) -> str:
        if x.info.name not in seen:
            # Outside the path's dynamo window (no event of this run is the path's), settings isolated.
            with _isolated(x.variant, alone=False):
                seen[x.info.name] = _observed_precision(state, x.variant, state.builds.get(x.info.name))
        got = seen[x.info.name]
        return got["level"] if got is not None else "off"

    for x in state.measured:
        if x is ref or ref is None or not _beyond(x, tolerance(state.dtype, x.computes_in)):
            continue
        own = observed(x) if x.variant.capture == "user" else "off"
        x.computes_in = loosest(x.computes_in, own, observed(ref))
    found = {k: v for k, v in seen.items() if v}
    if found:
        state.evidence["precision"] = found


def _beyond(x: _Measured, rtol: float) -> bool:
    """Some gradient of the path differs from the reference's by more than ``rtol`` (relative L1)."""
    return any(e is not None and e > rtol for m in x.results for e in m.rel_errors or ())


def _observed_precision(state: _Probe, variant: VariantSpec, built: Built | None) -> dict[str, Any] | None:
    """The precision the path computes in, seen in one more run with compiled code off
    (``evidence.precision``): for the reference and the user's own paths, whose autocast or casts the
    probe does not set. None when it computes at the parameters' precision."""
    from .evidence.precision import observe

    spec, model, batch = state.spec, state.model, state.batch
    weights = make_weights(state.terms, state.terms, state.params[0])
    if built is None:
        call = (
            (lambda: spec.step(model, batch))
            if state.mode == "terms"
            else (lambda: spec.step(model, batch, weights))
        )
    elif built.error is None and built.run is not None:
        run = built.run
        call = lambda: run(batch, weights)  # noqa: E731
    else:
        return None
    with stage("the precision it computes in"):
        reseed(spec.seed)
        return observe(call, state.params[0].dtype)


def _second_batch(state: _Probe) -> None:
    """The traced variants re-measured on ``spec.second_batch``: a trace that froze trace-time tensors
    is exact on its own batch only."""
    if state.spec.second_batch is None or not any(m.variant.traced for m in state.measured[1:]):
        return
    with stage("the second batch"):
        second = _compare_on(state, state.spec.second_batch)
    for m in state.measured:
        if m.info.name in second:
            m.info = msgspec.structs.replace(m.info, second_batch=second[m.info.name])


def _run_checks(state: _Probe) -> None:
    """The checks, into ``state.checked`` (the flow map's ``checks``): value consistency between variants
    (always, with more than one), then those asked for: shapes, physics, balance, training."""
    spec, model, mode, terms, scenarios, batch = (
        state.spec, state.model, state.mode, state.terms, state.scenarios, state.batch
    )  # fmt: skip
    measured, ref_results, ref_name = state.measured, state.ref_results, state.reference
    trainable_names = [n for n, _ in state.trainable]
    if len(measured) > 1:
        state.checked["consistency"] = consistency_report(
            trainable_names, measured, ref_results, ref_name, state.dtype, [t.numel() for t in state.params]
        )
    if "shapes" in state.checks:
        if spec.other_shapes_batch is None:
            raise SpecError("the shape sweep needs spec.other_shapes_batch (a batch of other sizes)")
        with stage("check: shapes (the traced variants on other shapes)"):
            state.checked["shape_sweep"] = _compare_on(state, spec.other_shapes_batch)
    if "physics" in state.checks:
        with stage("check: physics (finite differences)"):
            state.checked["physics"] = _checked("physics", lambda: physics_check(spec, model, spec.batch))
            paths = _physics_of_paths(state)
        if paths:
            state.checked["physics_paths"] = paths
    if "balance" in state.checks:
        with stage("check: balance"):
            state.checked["balance"] = _checked(
                "balance",
                lambda: balance_report(
                    spec, model, trainable_names, scenarios, ref_results,
                    _terms_caller(spec, model, mode, terms, batch),
                ),
            )  # fmt: skip
    if "training" in state.checks:
        with stage("check: training (optimizer steps on a copy)"):
            state.checked["training"] = _checked(
                "training",
                lambda: training_check(
                    spec, model, [x.variant for x in measured], mode, terms, scenarios, batch, ref_name
                ),
            )
    if "gradients" in state.checks or state.diagnose:
        with stage("check: gradients (finite differences of each term)"):
            state.checked["gradients"] = _checked("gradients", lambda: _gradients(state))


def _gradients(state: _Probe) -> dict[str, Any]:
    """The finite-difference check of every path that measured each term (``gradcheck.py``): the
    reference on a float64 copy where it can, the other paths on the model itself."""
    from . import gradcheck

    spec, model, mode, terms, batch = state.spec, state.model, state.mode, state.terms, state.batch
    paths = []
    step_seconds = 0.0
    calibration = None
    for x in state.measured:
        if all(m.error is not None for m in x.results):
            continue  # nothing measured on this path: nothing to check its gradients against
        step_seconds = max(step_seconds, max(m.seconds for m in x.results))
        built = state.builds.get(x.info.name)
        if built is None:  # a plain eager path: the step itself
            if x.info.name != state.reference and any(p.name == state.reference for p in paths):
                continue  # the same computation as the reference
            weighted = VariantContext(model, spec.step, mode, terms, batch, {}, seed=spec.seed).weighted()
            path = gradcheck.reference_path(x.info.name, model, weighted, batch, terms, mode, spec.seed)
            paths.append(path)
            if path.on != "the model":  # the step as written in the model's own dtype: the other paths' noise
                calibration = gradcheck.Path(
                    x.info.name, lambda w, f=weighted: f(model, batch, w), list(state.trainable),
                    list(model.buffers()), "the model",
                )  # fmt: skip
        elif built.run is not None:
            run = built.run
            paths.append(
                gradcheck.Path(
                    x.info.name, lambda w, run=run: run(batch, w), list(state.trainable), list(model.buffers()),
                    "the model",
                )
            )  # fmt: skip
    return gradcheck.gradients_check(
        paths, terms, mode, spec.seed, gradcheck.budget(step_seconds), calibration=calibration
    )


def _gather_evidence(state: _Probe) -> None:
    """What dynamo did per variant, whether it is switched off, the paths' own advice; with ``diagnose``:
    each path's lineage, finite-difference confirmations, bisections of the failing variants and the
    op that makes a non-finite value."""
    state.evidence["dynamo"] = {name: w.to_dict() for name, w in state.watches.items()}
    off = _dynamo_disabled() if state.builds else None
    if off is not None:
        state.evidence.setdefault("environment", {})["dynamo_disabled"] = off
    advice = {name: dict(b.advice) for name, b in state.builds.items() if b.advice}
    if advice:  # a path's own words for a fix (a trainer adapter's), whatever the cause needs
        state.evidence["advice"] = advice
    if not state.diagnose:
        return
    from .evidence import collect

    spec, model, trainable, params, mode, terms, scenarios, batch = (
        state.spec, state.model, state.trainable, state.params, state.mode, state.terms, state.scenarios,
        state.batch,
    )  # fmt: skip
    measured, builds, ref_results = state.measured, state.builds, state.ref_results
    with stage("diagnose: lineage (one recorded step per path)"):
        found = collect.lineages(spec, model, trainable, mode, terms, batch, measured, builds)
    state.evidence["lineage"] = {name: lin.to_dict() for name, lin in found.items()}
    with stage("diagnose: finite-difference confirmations"):
        state.evidence["confirmations"] = collect.confirmations(
            spec, model, trainable, mode, terms, scenarios, batch, measured, builds, found
        )
    with stage("diagnose: bisect"):
        state.bisections = collect.bisect_failing(
            spec, model, params, mode, terms, scenarios, batch, measured, ref_results, state.reference,
            state.dtype, state.model_training, [n for n, _ in trainable],
        )  # fmt: skip
    with stage("diagnose: locate non-finite values"):
        state.breaks = collect.locate_nonfinite(spec, model, mode, terms, batch, ref_results)


def _isolated(variant: VariantSpec, alone: bool) -> contextlib.AbstractContextManager[Any]:
    """Settings a variant changes kept from the next variant, the checks and the diagnosis; not needed
    (a snapshot and a restore of every registered global, a few tenths of a millisecond) for a lone
    plain-eager variant, whose changes ``preserved`` undoes. A compiled variant is isolated even alone:
    its isolation also covers compiler configs first imported by the variant itself."""
    if alone and _is_plain_eager(variant):
        return contextlib.nullcontext()
    return isolated_settings(import_configs=not _is_plain_eager(variant))


def _observed(watch: Watch, scenarios: Sequence[Scenario]) -> Any:
    """Around each scenario's run: dynamo's event window and the progress stage (scenario k of n)."""
    index = {s.name: i for i, s in enumerate(scenarios, 1)}

    @contextlib.contextmanager
    def observe(name: str) -> Iterator[None]:
        with watch.window(name), stage(f"scenario {index.get(name, '?')}/{len(scenarios)} {name}"):
            yield

    return observe


def _physics_of_paths(state: _Probe) -> dict[str, Any]:
    """The physics check of every path that gives its own forces (``Built.predict``; a model compiled
    alone through ``spec.predict``), and its outputs against the reference's. In float64 only: the
    path itself is checked, not a copy, and finite differences need the precision."""
    from .checks import path_physics

    spec, model = state.spec, state.model
    out: dict[str, Any] = {}
    if (
        spec.energy_fn is None
        or spec.predict is None
        or (spec.geometry is None and not isinstance(spec.batch, Mapping))
    ):
        return out
    for x in state.measured:
        built = state.builds.get(x.info.name)
        if x.info.name == state.reference or built is None or built.error is not None:
            continue
        if built.predict is not None:
            predict, energy = built.predict, (lambda b, p=built.predict: p(b)["energy"])
        elif built.module is not None:
            module = built.module
            predict = lambda b, m=module: spec.predict(m, b)  # type: ignore[misc]  # noqa: E731
            energy = lambda b, m=module: spec.energy_fn(m, b)  # type: ignore[misc]  # noqa: E731
        else:
            continue
        if next(model.parameters()).dtype != torch.float64:
            out[x.info.name] = {"skipped": "the model is not float64: finite differences on the path itself "
                                "need float64 (the reference is checked on a float64 copy)"}  # fmt: skip
            continue

        def run(predict: Any = predict, energy: Any = energy) -> dict[str, Any]:
            with torch.enable_grad():
                reference = dict(spec.predict(model, spec.batch))  # type: ignore[misc]
                reference.setdefault("energy", spec.energy_fn(model, spec.batch))  # type: ignore[misc]
            return path_physics(spec, predict, energy, spec.batch, reference)

        out[x.info.name] = _checked(f"physics ({x.info.name})", run)
    return out


def _checked(name: str, run: Any) -> dict[str, Any]:
    """A check's result; a check that raised (other than for bad input) is recorded as failed."""
    try:
        return run()
    except GradProbeError:
        raise
    except Exception as e:
        from .frames import user_frame_of

        text = str(e).strip()
        where = user_frame_of(e)  # the user's frame the failure came from
        return {
            "passed": False,
            "error": f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}",
            **({"error_where": where} if where else {}),
        }


def _compare_per_term(results: list[Measurement], reference: Mapping[str, Measurement]) -> list[Measurement]:
    # A second plain-eager variant in terms mode: values compare trivially (same computation).
    for m in results:
        ref = reference.get(m.scenario)
        if ref is not None and m.norms is not None and ref.norms is not None:
            m.rel_errors = [None if a is None else 0.0 for a in m.norms]
    return results


def _terms_caller(spec: ProbeSpec, model: torch.nn.Module, mode: str, terms: list[str], batch: Any) -> Any:
    """A call returning the step's term values (weights mode: all weights on)."""

    def call() -> Any:
        reseed(spec.seed)
        if mode == "terms":
            return spec.step(model, batch)
        out = spec.step(model, batch, make_weights(terms, terms, next(model.parameters())))
        return out[1] if isinstance(out, tuple) else {}

    return call


def _lint(built: Built | None, n_params: int) -> dict[str, Any] | None:
    if built is None or built.graph is None:
        return None
    found = lint(built.graph, n_params if built.graph_params is None else built.graph_params)
    return {**found, "advice": dict(built.advice)} if built.advice else found


def _compiles(results: list[Measurement]) -> int:
    """Runs during which the backend compiled something: 1 when the variant compiled once for all."""
    return sum(1 for m in results if m.compiled_graphs)


def _dynamo_disabled() -> dict[str, Any] | None:
    """How dynamo is switched off for the process, as ``torch.compile`` itself checks: the environment
    variable ``TORCHDYNAMO_DISABLE=1`` or ``torch._dynamo.config.disable``; None when it is on."""
    config = bool(getattr(sys.modules.get("torch._dynamo.config"), "disable", False))
    env = os.environ.get("TORCHDYNAMO_DISABLE")
    return {"env": env, "config": config} if config or env == "1" else None


def _graph_breaks() -> int:
    utils = sys.modules.get("torch._dynamo.utils")
    return sum(utils.counters["graph_break"].values()) if utils is not None else 0


def _compare_on(state: _Probe, batch2: Any) -> dict[str, dict[str, Any]]:
    """Re-measure traced variants on another batch, against eager on that batch.

    On a second batch of the same shapes: a trace can freeze trace-time tensors (``pre_dispatch=True``
    does) and still look exact on the batch it was traced on. On a batch of other shapes: traced and
    compiled graphs can lock onto the first batch's shapes. One scenario suffices: the one with the
    most terms among those that ran on the first batch. Term values are compared too: stale forces
    show in the force term's value even where no gradient can be taken.
    """
    spec, model, params, mode, terms = state.spec, state.model, state.params, state.mode, state.terms
    scenarios, measured, builds, ref_name = state.scenarios, state.measured, state.builds, state.reference
    if not scenarios or not any(m.variant.traced and m.info.name != ref_name for m in measured):
        return {}  # nothing traced to re-measure (an eager-only probe): no eager run either
    batch2 = with_differentiable_inputs(batch2, spec.differentiable_inputs)
    first = params[0]
    if mode == "terms":
        ctx = VariantContext(
            model, spec.step, mode, terms, batch2, make_weights(terms, terms, first), seed=spec.seed
        )
        weighted = ctx.weighted()

        def eager(w: Any) -> Any:
            return weighted(model, batch2, w)
    else:

        def eager(w: Any) -> Any:
            return spec.step(model, batch2, w)

    by_terms = sorted(scenarios, key=lambda s: -len(s.terms))
    references: dict[str, Measurement] = {}
    names: list[str] | None = None  # listed on first use: most probes compare no traced variant
    out: dict[str, dict[str, Any]] = {}
    for m in measured:
        ok = {r.scenario for r in m.results if r.error is None}
        if m.info.name == ref_name or not m.variant.traced or m.info.name not in builds or not ok:
            continue
        scenario = next(s for s in by_terms if s.name in ok)
        if scenario.name not in references:
            (references[scenario.name],) = per_scenario(
                eager, params, [scenario], terms, spec.seed, keep=True, isolate=mode == "terms"
            )
        ref = references[scenario.name]
        run = builds[m.info.name].run
        assert run is not None
        (res,) = per_scenario(
            lambda w, run=run: run(batch2, w),
            params,
            [scenario],
            terms,
            spec.seed,
            reference={scenario.name: ref},
            isolate=mode == "terms",
        )
        rtol = tolerance(precision(first), m.computes_in)
        entry: dict[str, Any] = {
            "scenario": scenario.name,
            "error": None,
            "max_rel_error": None,
            "mismatched": [],
            "term_values": {},
        }
        for t, value in res.term_values.items():
            expected = ref.term_values.get(t)
            if value is not None and expected is not None and not _close(value, expected, rtol):
                entry["term_values"][t] = {"variant": value, "reference": expected}
        if res.error is not None or ref.error is not None:
            err = res.error or ref.error
            assert err is not None
            entry["error"] = f"{err.stage}: {err.type}: {err.message}"
        elif res.rel_errors is not None:
            finite = [e for e in res.rel_errors if e is not None]
            entry["max_rel_error"] = max(finite) if finite else 0.0
            if names is None:
                names = [n for n, p in model.named_parameters() if p.requires_grad]
            entry["mismatched"] = [
                n
                for n, e, st, rst in zip(
                    names, res.rel_errors, res.statuses or [], ref.statuses or [], strict=False
                )
                if verdict(rst, st, e, rtol) != "match"
            ]
        out[m.info.name] = entry
    return out


def _close(a: float, b: float, rtol: float) -> bool:
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-300) or a == b


def _stochastic_warnings(model: torch.nn.Module, measured: list[_Measured]) -> list[str]:
    if len(measured) < 2:
        return []
    drop = [
        n or type(m).__name__
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training and m.p > 0
    ]
    if not drop:
        return []
    return [
        f"stochastic ops in the step ({', '.join(drop[:4])}): every run is reseeded and inductor uses fallback_random, "
        "but a compiled path may still draw differently from eager; value differences on the affected "
        "parameters may be noise. Probe in eval mode for dropout, or set p=0, to compare exactly"
    ]


def _precision_warnings(dtype: str) -> tuple[str, ...]:
    if dtype != "tf32":
        return ()
    return (
        "float32 matrix products run in TF32 on this device (torch.backends.cuda.matmul.allow_tf32 or "
        "set_float32_matmul_precision): gradients are compared at a 10-bit mantissa's tolerance "
        f"(relative L1 {tolerance('tf32'):g}, consistency {consistency_tolerance('tf32'):g}); turn TF32 off "
        "to compare at float32's",
    )


def _observed_precision_warnings(seen: Mapping[str, Any], reference: str, dtype: str) -> tuple[str, ...]:
    """What the probe saw of a path computing below its parameters' precision, and the tolerance that
    follows (``evidence.precision``)."""
    out = []
    for name, got in seen.items():
        ops = ", ".join(list(got["ops"])[:3])
        whom = "every path is compared with it" if name == reference else f"it is compared with {reference}"
        out.append(
            f"{name} computes in {got['dtype']} ({got['count']} op results in {got['dtype']} in one run with compiled "
            f"code off, e.g. {ops}: autocast or casts in its code) while the parameters are {dtype}: {whom} at "
            f"{got['dtype']}'s tolerance (relative L1 {tolerance(dtype, got['level']):g}), so differences below it "
            "are rounding, not wrong values"
        )
    return tuple(out)


def _flow_map(state: _Probe) -> FlowMap:
    """The flow map of the measured runs, with the checks' results and the evidence gathered."""
    spec, model, named, trainable = state.spec, state.model, state.tree.parameters, state.trainable
    measured, ref_name, dtype, scenarios = state.measured, state.reference, state.dtype, state.scenarios
    trainable_names = [n for n, _ in trainable]
    frozen = [n for n, p in named if not p.requires_grad]
    ref_status = {
        (m.scenario): m.statuses for x in measured if x.info.name == ref_name for m in x.results
    }  # fmt: skip
    ref_norms_of = {m.scenario: m.norms for x in measured if x.info.name == ref_name for m in x.results}
    numels: list[int] | None = None  # listed on first use: only a compared run needs them
    runs: list[Run] = []
    cells: list[Cell] = []
    for x in measured:
        rtol = tolerance(dtype, x.computes_in)
        for m in x.results:
            runs.append(
                Run(x.info.name, m.scenario, m.term_values, m.total, m.error, m.seconds, m.compiled_graphs,
                    m.grad_cosine, m.grad_scale, m.metrics)
            )  # fmt: skip
            if m.statuses is None or m.norms is None:
                continue
            if not len(m.statuses) == len(m.norms) == len(trainable_names):
                raise AssertionError(
                    f"{x.info.name}, {m.scenario}: a status and a norm per trainable parameter"
                )
            n = len(trainable_names)
            rel: Sequence[float | None] = [None] * n
            verdicts: Sequence[str | None] = [None] * n
            refs = ref_status.get(m.scenario) if x.info.name != ref_name else None
            if refs is not None:
                if numels is None:
                    numels = [p.numel() for _, p in trainable]
                rel = m.rel_errors or rel
                ref_norms = ref_norms_of.get(m.scenario) or [None] * n
                verdicts = judge(refs, ref_norms, m.statuses, m.norms, rel, numels, dtype, rtol)
            cells += [
                Cell(x.info.name, m.scenario, p, st, norm, r, v)
                for p, st, norm, r, v in zip(trainable_names, m.statuses, m.norms, rel, verdicts, strict=True)
            ]
            # Frozen parameters cannot receive a gradient: recorded as none, not counted as trainable.
            cells += [Cell(x.info.name, m.scenario, p, "none", None) for p in frozen]
    first = trainable[0][1]
    expect = normalized_expect(spec.expect)
    if expect:  # (else after the eager call, where the terms come from the step)
        check_against(expect, [s.name for s in scenarios], trainable_names)
    return FlowMap(
        torch_version=torch.__version__,
        device=str(first.device),
        dtype=dtype,
        mode=state.mode,
        terms=tuple(state.terms),
        scenarios=tuple(ScenarioInfo(s.name, s.terms) for s in scenarios),
        variants=tuple(x.info for x in measured),
        runs=tuple(runs),
        parameters=tuple(
            ParameterInfo(
                n,
                tuple(p.shape),
                p.numel(),
                p.requires_grad,
                str(p.dtype).removeprefix("torch."),
                str(p.device),
            )
            for n, p in named
        ),
        cells=tuple(cells),
        gradprobe_version=__version__,
        notes=dict(spec.notes),
        expect=expect,
        reference=ref_name,
        rtol=tolerance(dtype),
        warnings=tuple(_stochastic_warnings(model, measured))
        + _precision_warnings(dtype)
        + _observed_precision_warnings(state.evidence.get("precision") or {}, ref_name, dtype),
        bisections=tuple(state.bisections),
        breaks=tuple(state.breaks),
        checks=state.checked,
        evidence=state.evidence,
    )
