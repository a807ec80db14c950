"""Running the collectors inside a probe (``diagnose=True``), the same way for every variant.

* lineage: one recorded step per path, all terms on (``lineage.record``, under ``force_eager``);
* confirmations: finite differences for dependence that left torch (``confirm.confirm``);
* bisection: of each variant that fails where the reference does not (or of a failing reference),
  by its knobs, or for a path without knobs by the ``force_eager`` stance and backend overrides;
* the op whose backward makes NaN, when a reference gradient is non-finite.

Re-uses the probe's reference gradients and re-measures only one failing scenario per trial; a trial
re-uses what its flip cannot change (the probe's run of a measured variant, a make_fx trace, a trial
an earlier bisection ran) and records its seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..build import Built, TraceCache, VariantContext, build
from ..compare import loosest, noise_pairs, tolerance, verdict
from ..measure import Measurement, per_scenario
from ..progress import stage
from ..rng import reseed
from ..scenarios import Scenario
from ..spec import ProbeSpec
from ..state import isolated_settings
from ..status import INF, NAN
from ..step import make_weights
from ..variants import VariantSpec
from .bisect import bisect, with_knobs
from .confirm import confirm
from .lineage import PathLineage, force_eager, merged, record

TOTAL = "__total__"  # the lineage key of a path that returns its total loss only


def mismatch(m: Measurement, ref: Measurement | None, rtol: float, numels: Sequence[int], dtype: str) -> bool:
    """The run differs from the reference: an error where the reference ran, or any cell not matching
    (below the noise floor both ways counts as a match)."""
    if m.error is not None:
        return ref is None or ref.error is None
    if ref is None or ref.statuses is None or m.statuses is None or ref.norms is None or m.norms is None:
        return False
    rel = m.rel_errors or [None] * len(m.statuses)
    noise = noise_pairs(ref.statuses, ref.norms, m.statuses, m.norms, numels, dtype)
    return any(
        verdict(r, s, e, rtol, n) != "match"
        for r, s, e, n in zip(ref.statuses, m.statuses, rel, noise, strict=True)
    )


def _terms_of(mode: str) -> Callable[[Any], Mapping[str, torch.Tensor]]:
    def terms_of(result: Any) -> Mapping[str, torch.Tensor]:
        if mode == "terms" and isinstance(result, Mapping):
            return result
        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Mapping) and result[1]:
            return result[1]
        return {TOTAL: result[0] if isinstance(result, tuple) else result}

    return terms_of


def _path_call(
    spec: ProbeSpec, model: torch.nn.Module, variant: VariantSpec, built: Built | None, mode: str,
    terms: Sequence[str], batch: Any, like: torch.Tensor, on: Sequence[str] | None = None,
) -> Callable[[], Any] | None:  # fmt: skip
    """One step of the path with every term on (or those ``on``), as the probe runs it; None if it
    cannot run."""
    weights = make_weights(terms, terms if on is None else on, like)
    if built is None:
        if mode == "terms":
            return lambda: spec.step(model, batch)
        return lambda: spec.step(model, batch, weights)
    if built.run is None:
        return None
    run = built.run
    return lambda: run(batch, weights)


def _label(variant: VariantSpec) -> str:
    if variant.capture == "eager" and variant.backend is None:
        return "the step as written, run eagerly"
    if variant.capture == "make_fx" and variant.backend is None:
        return "the traced graph, replayed op by op"
    return (
        "eager execution of the path's Python (compiled code off, force_eager stance); traced graphs "
        "are replayed op by op: this is not the compiled measurement"
    )


def lineages(
    spec: ProbeSpec, model: torch.nn.Module, named: Sequence[tuple[str, torch.Tensor]], mode: str,
    terms: Sequence[str], batch: Any, measured: Sequence[Any], builds: Mapping[str, Built],
) -> dict[str, PathLineage]:  # fmt: skip
    """One recorded step per variant."""
    out: dict[str, PathLineage] = {}
    like = named[0][1]
    for x in measured:
        built = builds.get(x.info.name)
        call = _path_call(spec, model, x.variant, built, mode, terms, batch, like)
        if call is None:
            continue
        reseed(spec.seed)
        with stage(x.info.name):
            lin = record(model, named, call, _label(x.variant), _terms_of(mode))
        if list(lin.terms) == [TOTAL] and len(terms) > 1:
            # The path returns only its total: one recording per term, that term's weight on and the
            # others 0 (a product with an exact zero carries no dependence).
            parts = {}
            for term in terms:
                call = _path_call(spec, model, x.variant, built, mode, terms, batch, like, on=[term])
                reseed(spec.seed)
                with stage(f"{x.info.name}: {term} only"):
                    parts[term] = record(model, named, call, _label(x.variant), _terms_of(mode))  # type: ignore[arg-type]
            lin = merged(
                parts, _label(x.variant) + "; one recording per term (the path returns its total only)"
            )
        out[x.info.name] = lin
    return out


def _alone(scenarios: Sequence[Scenario]) -> dict[str, str]:
    """term -> the scenario that switches on that term alone."""
    return {s.terms[0]: s.name for s in scenarios if len(s.terms) == 1}


def unreached(m: Measurement | None, names: Sequence[str]) -> set[str]:
    """Parameters with no gradient or an exact zero in a run; every parameter when the run had no
    gradient path at all; nothing when it failed otherwise (no evidence)."""
    if m is None:
        return set()
    if m.error is not None:
        return set(names) if m.error.type == "NoGradPath" else set()
    return {n for n, st in zip(names, m.statuses or [], strict=False) if st in ("none", "zero")}


def confirmations(
    spec: ProbeSpec, model: torch.nn.Module, named: Sequence[tuple[str, torch.Tensor]], mode: str,
    terms: Sequence[str], scenarios: Sequence[Scenario], batch: Any, measured: Sequence[Any],
    builds: Mapping[str, Built], found: Mapping[str, PathLineage],
) -> dict[str, list[dict[str, Any]]]:  # fmt: skip
    """Finite differences for each leaving site (``.item()``, NumPy...) whose parameters a term does
    not reach by gradient: does the term's value move with them?"""
    names = [n for n, _ in named]
    params = dict(named)
    alone = _alone(scenarios)
    out: dict[str, list[dict[str, Any]]] = {}
    for x in measured:
        lin = found.get(x.info.name)
        if lin is None or lin.error is not None:
            continue
        results = {m.scenario: m for m in x.results}
        candidates = []
        for site in lin.sites:
            if not site.leaving:
                continue
            # Each term is moved along its own missing parameters only: moving the union would confirm a
            # term that depends on another term's missing parameter through a route that carries gradient.
            by_hit: dict[tuple[str, ...], list[str]] = {}
            for term, tl in lin.terms.items():
                m = results.get(alone.get(term, "")) if term != TOTAL else _all_run(results, scenarios)
                missing = unreached(m, names) - set(tl.carries)
                hit = tuple(p for p in site.parameters if p in missing)
                if hit:
                    by_hit.setdefault(hit, []).append(term)
            candidates.extend((str(site.id), list(hit), cut_terms) for hit, cut_terms in by_hit.items())
        if not candidates:
            continue
        call = _path_call(spec, model, x.variant, builds.get(x.info.name), mode, terms, batch, named[0][1])
        if call is None:
            continue
        try:
            out[x.info.name] = confirm(_term_values(call, mode, spec.seed), params, candidates, spec.seed)
        except Exception as e:  # best effort: the lineage stands, unconfirmed
            out[x.info.name] = [{"error": f"{type(e).__name__}: {e}"[:300]}]
    return out


def _term_values(call: Callable[[], Any], mode: str, seed: int) -> Callable[[], dict[str, float]]:
    """The path's term values as floats, each call reseeded and run with compiled code off (the same
    Python the lineage saw)."""
    terms_of = _terms_of(mode)

    def values() -> dict[str, float]:
        reseed(seed)
        with force_eager():
            got = terms_of(call())
        return {t: float(v.detach().double()) for t, v in got.items() if isinstance(v, torch.Tensor)}

    return values


def _all_run(results: Mapping[str, Measurement], scenarios: Sequence[Scenario]) -> Measurement | None:
    widest = max(scenarios, key=lambda s: len(s.terms), default=None)
    return results.get(widest.name) if widest is not None else None


def bisect_failing(
    spec: ProbeSpec,
    model: torch.nn.Module,
    params: list[torch.Tensor],
    mode: str,
    terms: list[str],
    scenarios: Sequence[Scenario],
    batch: Any,
    measured: Sequence[Any],
    ref_results: Mapping[str, Measurement],
    ref_name: str,
    dtype: str,
    model_training: bool,
    names: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """One bisection per variant that fails where the reference does not (or per failing reference).

    What a trial would only repeat is not recomputed: a trial of a variant the probe measured takes
    the probe's own run of that scenario (the failing variant itself, as the top rung of its backend
    ladder; a fix the user also asked to measure), and make_fx traces are shared between trials that
    change only the compile (``build.TraceCache``). The reference's gradients are the probe's.

    A trial is judged on the failing scenario, and where that is right, on every other scenario too
    (same build, one more run each): its ``ok`` says the flow matches the reference in reach and
    value everywhere it was measured (``scenarios``). ``names``: the trainable parameters' names, for
    the cells a trial's result says differ.
    """
    by_name = {s.name: s for s in scenarios}
    numels = [p.numel() for p in params]
    traces = TraceCache()  # one probe's diagnosis: the model, batch and step stay as they are
    tried: list[tuple[tuple[str, bool], VariantSpec, tuple[bool, str, dict[str, Any]]]] = []
    out = []

    # The precision the failing path is compared at (its knob, or what was observed of it or of the
    # reference): a trial of that path is judged at it too, or at its own knob where that is looser.
    failing_level = {"level": "off"}

    def level_of(v: VariantSpec) -> str:
        return loosest(
            v.knobs.get("autocast", "off") if v.capture != "user" else "off", failing_level["level"]
        )

    def judge(m: Measurement, v: VariantSpec, is_ref: bool) -> tuple[bool, str]:
        if m.error is not None:
            return False, f"{m.error.stage}: {m.error.message}"
        reached = sum(st == "nonzero" for st in m.statuses or [])
        if is_ref:
            # Nothing to compare with: the flow is restored when the run works and reaches something.
            return reached > 0, f"{reached} reached, no error"
        bad = mismatch(m, ref_results.get(m.scenario), tolerance(dtype, level_of(v)), numels, dtype)
        if not bad:
            return True, f"{reached} reached, matches the reference"
        return False, f"{reached} reached, differs from the reference" + _how(m, v)

    def _how(m: Measurement, v: VariantSpec) -> str:
        """' (missing: a, b; extra: c)': the cells that differ, by verdict, where names are known."""
        ref = ref_results.get(m.scenario)
        if not names or ref is None or ref.statuses is None or m.statuses is None:
            return ""
        rtol = tolerance(dtype, level_of(v))
        rel = m.rel_errors or [None] * len(m.statuses)
        noise = noise_pairs(ref.statuses, ref.norms or [], m.statuses, m.norms or [], numels, dtype)
        by: dict[str, list[str]] = {}
        for n, r, st, e, z in zip(names, ref.statuses, m.statuses, rel, noise, strict=False):
            got = verdict(r, st, e, rtol, z)
            if got != "match":
                by.setdefault(got, []).append(n)
        parts = [
            f"{k}: {', '.join(ps[:4])}" + (f" (+{len(ps) - 4})" if len(ps) > 4 else "")
            for k, ps in by.items()
        ]
        return f" ({'; '.join(parts)})" if parts else ""

    def verdict_over(ms: Sequence[Measurement], v: VariantSpec, is_ref: bool) -> tuple[bool, str, list[str]]:
        """A trial's verdict: the failing scenario first; where it is right, every other scenario the
        trial measured must be right too (a flip that fixes one scenario and breaks another — a
        ``detach=alias`` that also removes the user's own ``detach()`` — does not restore the flow)."""
        ok, result = judge(ms[0], v, is_ref)
        seen = [ms[0].scenario]
        if not ok:
            return ok, result, seen
        for m in ms[1:]:
            seen.append(m.scenario)
            good, why = judge(m, v, is_ref)
            if not good:
                return False, f"{ms[0].scenario}: {result}; {m.scenario}: {why}", seen
        if len(ms) > 1:
            result = f"{ms[0].scenario}: {result}; {', '.join(m.scenario for m in ms[1:])}: " + (
                "run and reach parameters too" if is_ref else "match too"
            )
        return True, result, seen

    for x in measured:
        failing_level["level"] = x.computes_in
        rtol = tolerance(dtype, x.computes_in)
        is_ref = x.info.name == ref_name
        if is_ref:
            failing = [m.scenario for m in x.results if m.error is not None]
        else:
            failing = [
                m.scenario for m in x.results if mismatch(m, ref_results.get(m.scenario), rtol, numels, dtype)
            ]
        if not failing:
            continue
        subset = [by_name[failing[0]]]  # the failing scenario first; the others only where it is right
        others = [s for s in scenarios if s.name != failing[0]]

        def check(
            v: VariantSpec,
            subset: list[Scenario] = subset,
            others: list[Scenario] = others,
            is_ref: bool = is_ref,
            reuse: bool = True,
        ) -> tuple[bool, str, dict[str, Any]]:
            if reuse:
                ms = [_measured_run(measured, v, s.name) for s in [*subset, *others]]
                if ms[0] is not None:
                    ok, result, seen = verdict_over([m for m in ms if m is not None], v, is_ref)
                    return (
                        ok,
                        f"{result} (the probe's own run of {v.name}, re-used)",
                        {"reused": "measurement", "scenarios": seen},
                    )
                # Another failing variant's bisection ran this very trial (two compiled variants of
                # one broken trace share their make_fx stage): same path, scenarios and judge.
                key = (subset[0].name, is_ref)
                done = next((got for k, u, got in tried if k == key and _same_path(u, v)), None)
                if done is not None:
                    return (
                        done[0],
                        f"{done[1]} (trial re-used from an earlier bisection)",
                        {"reused": "trial", "scenarios": done[2].get("scenarios")},
                    )
            with isolated_settings(import_configs=True):  # one trial's config changes stay in that trial
                got = _trial(v, subset, others, is_ref, traces if reuse else None)
            if reuse:
                tried.append(((subset[0].name, is_ref), v, got))
            return got

        def _trial(
            v: VariantSpec, subset: list[Scenario], others: list[Scenario], is_ref: bool,
            traces: TraceCache | None,
        ) -> tuple[bool, str, dict[str, Any]]:  # fmt: skip
            ctx = VariantContext(
                model, spec.step, mode, terms, batch, make_weights(terms, terms, params[0]), seed=spec.seed
            )
            start, reused = time.perf_counter(), traces.reused if traces is not None else 0
            built = build(v, ctx, traces)
            # Where a trial's time goes: the build (make_fx's trace; a torch.compile wrapper is lazy),
            # dynamo's compile (inside the first run) and the runs themselves.
            timing: dict[str, Any] = {"build_s": round(time.perf_counter() - start, 4)}
            if traces is not None and traces.reused > reused:
                timing["reused"] = "trace"
            if built.error is not None:
                timing["scenarios"] = [subset[0].name]
                return False, f"{built.error.stage} failed: {built.error.message}", timing
            start, compiling = time.perf_counter(), _compile_seconds()

            def runs(which: list[Scenario]) -> list[Measurement]:
                return per_scenario(
                    lambda w, run=built.run: run(batch, w),  # type: ignore[misc]
                    params, which, terms, spec.seed,
                    reference=None if is_ref else ref_results, counter=built.counter, isolate=mode == "terms",
                )  # fmt: skip

            ms = runs(subset)
            if judge(ms[0], v, is_ref)[0] and others:
                ms += runs(others)
            ok, result, seen = verdict_over(ms, v, is_ref)
            compile_s = _compile_seconds() - compiling
            timing["compile_s"] = round(compile_s, 4)
            timing["run_s"] = round(time.perf_counter() - start - compile_s, 4)
            timing["scenarios"] = seen
            return ok, result, timing

        found = bisect(x.variant, failing[:1], check, model_training).to_dict()
        # torch's CompilerBisector re-runs the failing path under changed compiler settings: every
        # call must really run (no re-used measurement, no shared trace).
        _hand_to_compiler_bisector(found, x.variant, lambda v: check(v, reuse=False))
        out.append(found)
    return out


def _measured_run(measured: Sequence[Any], v: VariantSpec, scenario: str) -> Measurement | None:
    """The probe's run of ``scenario`` on the variant ``v`` is, if the probe measured it: the same
    built-in path (same canonical name, once both are normalised), or the very same user variant."""
    for x in measured:
        if _same_path(x.variant, v):
            return next((m for m in x.results if m.scenario == scenario), None)
    return None


def _same_path(a: VariantSpec, b: VariantSpec) -> bool:
    """Built-in variants by canonical name (knobs at their defaults dropped); a user variant (or an
    override's rebuilt path) only as the very same spec: same builder, same knobs."""
    if a.builder is not None or b.builder is not None:
        return a == b
    return with_knobs(a).name == with_knobs(b).name


def _compile_seconds() -> float:
    """Seconds dynamo has spent compiling frames in this process (its own metric, bytecode tracing and
    the backend together): read around a trial's runs, it splits compile from run time whoever called
    torch.compile. 0 where this torch does not keep the metric."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return 0.0
    return float(sum(compilation_time_metrics.get("_compile.compile_inner", ())))


def _hand_to_compiler_bisector(found: dict[str, Any], failing: VariantSpec, check: Any) -> None:
    """Opt-in (``compiler_bisect=True``): when the backend ladder ends at a backend with subsystems,
    torch's CompilerBisector names the pass, decomposition or lowering inside it."""
    from . import compiler_passes

    culprit = found.get("culprit") or {}
    backend = culprit.get("backend")
    if not (
        compiler_passes.wanted()
        and culprit.get("ladder")
        and not found.get("not_overridable")
        and (backend in compiler_passes.WITH_SUBSYSTEMS or backend == "the path's own backend")
        and compiler_passes.available()
    ):
        return
    passes = compiler_passes.bisect_passes(failing.name, lambda: check(failing)[0])
    found["compiler_bisect"] = passes
    found["summary"] = f"{found['summary']}; {compiler_passes.describe(passes)}"


def locate_nonfinite(
    spec: ProbeSpec, model: torch.nn.Module, mode: str, terms: list[str], batch: Any,
    ref_results: Mapping[str, Measurement],
) -> list[dict[str, Any]]:  # fmt: skip
    """The first op whose backward produces NaN/Inf, when a reference gradient is non-finite."""
    from .locate import locate_nonfinite_backward

    nonfinite = [
        s
        for s, m in ref_results.items()
        if m.statuses is not None and any(st in (NAN, INF) for st in m.statuses)
    ]
    if not nonfinite or mode != "terms":
        return []
    term = next((t for t in terms if f"{t} only" in nonfinite), terms[0])
    try:
        reseed(spec.seed)
        found = locate_nonfinite_backward(model, lambda: spec.step(model, batch), term)
    except Exception:
        return []
    return [found.to_dict()] if found is not None else []
