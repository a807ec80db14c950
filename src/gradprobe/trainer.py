"""Probing a trainer you did not write: a small protocol, and the glue that turns it into a probe.

A trainer (DeePMD-kit's, a Lightning module, your own class) is probed in weights mode through its
*own* code paths. An adapter says five things::

    class MyTrainerAdapter:
        name = "mytrainer"                       # prefix of the variant names in the report
        terms = ("energy", "force")              # the loss terms the trainer can switch on and off
        configurations = {                       # its execution paths; the first is the reference
            "uncompiled": {},
            "compiled": {"backend": ("inductor", ("inductor", "aot_eager"))},   # knob: (default, allowed)
        }

        def module(self):                        # the nn.Module whose parameters the trainer trains
            return self.trainer.model

        def batch(self):                         # one batch, in the trainer's own format
            return self.trainer.next_batch()

        def loss(self, model, batch, weights):   # the reference configuration's total loss, on `model`
            return self.trainer.compute_loss(model, batch, term_weights=weights)

        def build(self, configuration, knobs, model):  # another configuration, built on `model`:
            step = self.trainer.compiled_loss(**knobs)    #   run(batch, weights) -> loss
            return lambda batch, weights: step(model, batch, weights)

``weights`` maps each term to a 0-dim tensor (1 = on, 0 = off): pass them where the trainer takes
per-term weights or label switches (DeePMD's ``find_energy``...). ``loss`` and ``build`` must work on
any copy of the module: ``build`` gets the module to build on (the probed one, or the copy the
training check steps), so every check measures the path it names; a ``build(configuration, knobs)``
without ``model`` still probes, but checks on copies report that they could not run it. ``build`` may
return a ``gradprobe.build.Built`` to add a
compile counter (proof that compiled code ran in each measurement) and the traced graph (for the
graph lint). Optional: ``second_batch()`` (catches graphs that froze trace-time values),
``notes`` (``{parameter prefix: why it may get no gradient}``), ``expect`` (``{scenario: [prefix, ...]}``
that must be reached), ``spec_fields()`` (more
``ProbeSpec`` fields, e.g. ``energy_fn``/``predict`` for the physics check).

``probe_trainer(adapter)`` measures every configuration in every scenario and compares gradient values
with the reference configuration; the knobs a configuration declares are what the bisector flips.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from .errors import SpecError
from .flowmap import FlowMap
from .spec import ProbeSpec
from .variants import KnobTable, VariantSpec, user_variant


@runtime_checkable
class TrainerAdapter(Protocol):
    """What gradprobe needs from a trainer (see the module docstring for an example)."""

    name: str
    terms: Sequence[str]
    configurations: Mapping[str, KnobTable]

    def module(self) -> torch.nn.Module: ...

    def batch(self) -> Any: ...

    def loss(self, model: torch.nn.Module, batch: Any, weights: Mapping[str, torch.Tensor]) -> Any: ...

    def build(self, configuration: str, knobs: Mapping[str, Any], model: torch.nn.Module) -> Any: ...


def _check(adapter: Any) -> None:
    missing = [m for m in ("name", "terms", "configurations", "module", "batch", "loss", "build")
               if not hasattr(adapter, m)]  # fmt: skip
    if missing:
        raise SpecError(
            f"{type(adapter).__name__} is not a trainer adapter: it lacks {', '.join(missing)} "
            "(see gradprobe.trainer for the protocol)"
        )
    if not adapter.configurations:
        raise SpecError(f"trainer adapter {adapter.name!r} declares no configurations")
    reference, table = next(iter(adapter.configurations.items()))
    if table:
        raise SpecError(
            f"{adapter.name}'s reference configuration {reference!r} declares knobs, but it runs through "
            "loss() and takes none: declare them on another configuration"
        )


def variant_name(adapter: Any, configuration: str) -> str:
    return f"{adapter.name}:{configuration}"


def trainer_variants(
    adapter: TrainerAdapter,
    configurations: Sequence[str] | None = None,
    knobs: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[VariantSpec]:
    """One variant per configuration (all, or those named), the reference configuration first.
    ``knobs``: ``{configuration: {knob: value}}`` to set some knobs off their defaults."""
    _check(adapter)
    names = list(adapter.configurations)
    chosen = list(configurations) if configurations is not None else names
    unknown = [c for c in chosen if c not in adapter.configurations]
    if unknown:
        raise SpecError(f"{adapter.name} has no configuration {unknown[0]!r}; it has: {', '.join(names)}")
    reference = names[0]
    out = []
    for conf in [reference, *[c for c in chosen if c != reference]]:
        builder = _reference_builder(adapter) if conf == reference else _builder(adapter, conf)
        values = dict((knobs or {}).get(conf, {}))
        out.append(
            user_variant(variant_name(adapter, conf), builder, dict(adapter.configurations[conf]), **values)
        )
    return out


def _reference_builder(adapter: TrainerAdapter) -> Callable[..., Any]:
    def builder(ctx: Any) -> Callable[..., Any]:
        return lambda batch, weights: adapter.loss(ctx.model, batch, weights)

    return builder


def _builder(adapter: TrainerAdapter, configuration: str) -> Callable[..., Any]:
    try:
        takes_model = "model" in inspect.signature(adapter.build).parameters
    except (TypeError, ValueError):
        takes_model = False

    def builder(ctx: Any) -> Any:
        if takes_model:
            return adapter.build(configuration, dict(ctx.knobs), model=ctx.model)
        if ctx.model is not adapter.module():
            # Built on its own module, the path would not depend on this copy: every term would read flat.
            raise SpecError(
                f"{adapter.name}.build() takes no model, so its {configuration!r} path cannot run on the copy "
                "a check trains: give it a `model` parameter, build(configuration, knobs, model), and build on it"
            )
        return adapter.build(configuration, dict(ctx.knobs))

    return builder


def parse_configurations(
    adapter: TrainerAdapter, text: str | None
) -> tuple[list[str] | None, dict[str, dict[str, Any]]]:
    """``"compiled[detach=keep]"`` or ``"deepmd:uncompiled,deepmd:compiled[backend=aot_eager]"`` (the
    command line's ``--variants`` for an adapter) as configurations and knob values."""
    from .variants import PART, parse_knobs, split_spellings

    if not text:
        return None, {}
    configurations: list[str] = []
    knobs: dict[str, dict[str, Any]] = {}
    for item in split_spellings(text):
        m = PART.match(item)
        head = m["head"].removeprefix(f"{adapter.name}:") if m is not None else item
        if m is None or head not in adapter.configurations:
            raise SpecError(
                f"{adapter.name} has no configuration {item!r}; it has: "
                + ", ".join(variant_name(adapter, c) for c in adapter.configurations)
            )
        configurations.append(head)
        knobs[head] = parse_knobs(m["knobs"], dict(adapter.configurations[head]), variant_name(adapter, head))
    return configurations, knobs


def trainer_spec(adapter: TrainerAdapter, **spec_fields: Any) -> ProbeSpec:
    """A weights-mode spec around the adapter: its module, its batch, its terms, its reference loss."""
    _check(adapter)
    second = getattr(adapter, "second_batch", None)
    fields: dict[str, Any] = {
        "model": adapter.module(),
        "step": adapter.loss,
        "batch": adapter.batch(),
        "terms": list(adapter.terms),
        "mode": "weights",
        "name": adapter.name,
        "notes": dict(getattr(adapter, "notes", {}) or {}),
        "expect": getattr(adapter, "expect", None),
    }
    if second is not None and "second_batch" not in spec_fields:
        fields["second_batch"] = second()
    extra = getattr(adapter, "spec_fields", None)
    if extra is not None:
        fields.update(extra())
    fields.update(spec_fields)
    return ProbeSpec(**fields)


def probe_trainer(
    adapter: TrainerAdapter,
    *,
    configurations: Sequence[str] | None = None,
    knobs: Mapping[str, Mapping[str, Any]] | None = None,
    diagnose: bool = False,
    checks: Sequence[str] = (),
    progress: bool = True,
    compiler_bisect: bool = False,
    **spec_fields: Any,
) -> FlowMap:
    """Probe the trainer's configurations against its reference (first) configuration.

    ``progress``, ``compiler_bisect``: as in ``probe()``. An adapter may run checks of its own (named in
    ``adapter.own_checks``; ``adapter.add_own_checks(fm, checks)`` returns the map with them and its
    findings read again): DeePMD's metrics and backends.

    >>> # fm = probe_trainer(DeepmdAdapter.from_config(config), diagnose=True); print(render(fm))
    """
    from .evidence import compiler_passes
    from .probe import run_probe
    from .progress import reporting, stage

    with reporting(progress), compiler_passes.enabled(compiler_bisect):
        with stage("the trainer's model and batch"):
            variants = trainer_variants(adapter, configurations, knobs)
            spec = trainer_spec(adapter, **spec_fields)
        own = tuple(getattr(adapter, "own_checks", ()))
        fm = run_probe(spec, variants, variants[0].name, diagnose, tuple(c for c in checks if c not in own))
        add = getattr(adapter, "add_own_checks", None)
        return add(fm, [c for c in checks if c in own]) if add is not None else fm


__all__ = [
    "TrainerAdapter",
    "parse_configurations",
    "probe_trainer",
    "trainer_spec",
    "trainer_variants",
    "variant_name",
]
