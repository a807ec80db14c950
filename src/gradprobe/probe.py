"""``probe()``: the one entry point. Spec in, flow map out; the user's model is left as found."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from . import __version__
from .batch import check_devices, with_differentiable_inputs
from .diagnose import diagnose
from .errors import SpecError
from .flowmap import Cell, FlowMap, Run, ScenarioInfo, VariantInfo, parameter_infos
from .measure import Measurement, per_scenario, per_term
from .scenarios import Scenario, resolve_scenarios
from .spec import ProbeSpec, resolve_model
from .state import preserved, reseed
from .variants import VariantSpec, parse_variants


def probe(
    model: torch.nn.Module | ProbeSpec | Any,
    step: Any = None,
    batch: Any = None,
    *,
    variants: str | Sequence[str | VariantSpec] = "eager",
    **spec_fields: Any,
) -> FlowMap:
    """Measure which parameters each loss term reaches, alone and all together.

    Call it with a spec, ``probe(spec, variants=...)``, or with the spec's fields,
    ``probe(model, step, batch, terms=[...])``. Returns the flow map; the model's parameters, ``.grad``,
    ``requires_grad`` flags, train/eval modes, buffers and RNG state are as they were.

    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> def step(m, b):
    ...     y = m(b)
    ...     return {"fit": y.pow(2).mean(), "bias_reg": m.bias.abs().sum()}
    >>> fm = probe(model, step, torch.ones(4, 2))
    >>> fm.count("eager", "bias_reg only")
    (1, 2)
    """
    if isinstance(model, ProbeSpec):
        if step is not None or batch is not None or spec_fields:
            raise SpecError("probe(spec) takes no other spec fields: use dataclasses.replace(spec, ...)")
        spec = model
    else:
        spec = ProbeSpec(model=model, step=step, batch=batch, **spec_fields)
    return run_probe(spec, parse_variants(variants))


def run_probe(spec: ProbeSpec, variants: Sequence[VariantSpec]) -> FlowMap:
    model = resolve_model(spec)
    named = list(model.named_parameters())
    trainable = [(n, p) for n, p in named if p.requires_grad]
    if not trainable:
        raise SpecError(
            f"the model ({type(model).__name__}) has no trainable parameters "
            f"({len(named)} parameters, none with requires_grad=True): nothing can receive a gradient"
        )
    check_devices(spec.batch, model)
    mode = spec.resolved_mode()
    if mode == "weights" and spec.terms is None:
        raise SpecError("a weights-mode step needs terms=[...]: the names of the weights it takes")
    params = [p for _, p in trainable]
    first = params[0]

    terms: list[str] = list(spec.terms) if spec.terms is not None else []
    scenarios: Sequence[Scenario] = ()
    variant_infos: list[VariantInfo] = []
    measured: list[tuple[str, list[Measurement]]] = []
    with preserved(model), torch.enable_grad():
        for variant in variants:
            start = time.perf_counter()
            if mode == "terms":
                reseed(spec.seed)
                batch = with_differentiable_inputs(spec.batch, spec.differentiable_inputs)
                terms, scenarios, results = per_term(
                    lambda b=batch: spec.step(model, b),
                    params,
                    spec.terms,
                    lambda ts: resolve_scenarios(spec.scenarios, ts),
                )
            else:
                scenarios = resolve_scenarios(spec.scenarios, terms)
                results = per_scenario(
                    lambda w: spec.step(
                        model, with_differentiable_inputs(spec.batch, spec.differentiable_inputs), w
                    ),
                    params,
                    scenarios,
                    terms,
                    spec.seed,
                )
            variant_infos.append(
                VariantInfo(variant.name, dict(variant.knobs), None, None, time.perf_counter() - start)
            )
            measured.append((variant.name, results))

    trainable_names = [n for n, _ in trainable]
    runs, cells = [], []
    for vname, results in measured:
        for m in results:
            runs.append(Run(vname, m.scenario, m.term_values, m.total, m.error, m.seconds))
            if m.statuses is None or m.norms is None:
                continue
            cells.extend(
                Cell(vname, m.scenario, n, st, nm)
                for n, st, nm in zip(trainable_names, m.statuses, m.norms, strict=True)
            )
            # Frozen parameters cannot receive a gradient: recorded as none, not counted as trainable.
            cells.extend(Cell(vname, m.scenario, n, "none", None) for n, p in named if not p.requires_grad)
    fm = FlowMap(
        torch_version=torch.__version__,
        device=str(first.device),
        dtype=str(first.dtype).removeprefix("torch."),
        mode=mode,
        terms=tuple(terms),
        scenarios=tuple(ScenarioInfo(s.name, s.terms) for s in scenarios),
        variants=tuple(variant_infos),
        runs=tuple(runs),
        parameters=parameter_infos(named),
        cells=tuple(cells),
        gradprobe_version=__version__,
        notes=dict(spec.notes),
    )
    return replace(fm, findings=tuple(diagnose(fm)))
