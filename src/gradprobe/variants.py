"""Variants: the ways of executing the same training step, and their short spelling.

    eager                         the user's step as written
    make_fx                       the step traced by make_fx (autograd.grad inside becomes plain ops)
    compile:<backend>             torch.compile of the step (eager, aot_eager, aot_eager_decomp_partition, inductor)
    make_fx+compile:<backend>     the traced graph, compiled (the pattern used for force training)

Knobs go in brackets after the part they belong to, e.g.
``make_fx[detach=alias,mode=eval]+compile:aot_eager[dynamic=true]``. Users register their own variants
(a trainer that compiles itself) with ``register_variant``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import SpecError, did_you_mean

EAGER = "eager"
BACKENDS = ("eager", "aot_eager", "aot_eager_decomp_partition", "inductor")

# Knobs of each part, with their defaults and allowed values (None: any value of that type).
STEP_KNOBS: dict[str, tuple[Any, tuple[Any, ...] | None]] = {
    "mode": ("as-is", ("as-is", "train", "eval")),  # module mode while the step runs / is traced
    "autocast": ("off", ("off", "bf16", "fp16")),
}
MAKE_FX_KNOBS: dict[str, tuple[Any, tuple[Any, ...] | None]] = {
    "tracing_mode": ("real", ("real", "symbolic")),
    "pre_dispatch": (False, (False, True)),
    "detach": ("keep", ("keep", "alias")),  # keep the recorded detach nodes, or decompose them to alias
}
COMPILE_KNOBS: dict[str, tuple[Any, tuple[Any, ...] | None]] = {
    "fullgraph": (False, (False, True)),
    "dynamic": (None, (None, False, True)),
}


@dataclass(frozen=True)
class VariantSpec:
    """One variant: how the step is captured, which backend compiles it, and the knobs.

    ``builder`` is set for user variants: ``builder(ctx) -> run(batch, weights)``.
    """

    name: str
    capture: str = "eager"  # eager | make_fx | user
    backend: str | None = None
    knobs: dict[str, Any] = field(default_factory=dict)
    builder: Callable[..., Any] | None = None

    @property
    def compiled(self) -> bool:
        return self.backend is not None

    @property
    def traced(self) -> bool:
        """Built from a capture of the step (may freeze trace-time values or shapes)."""
        return self.capture != "eager" or self.backend is not None

    def knob(self, name: str) -> Any:
        for table in (STEP_KNOBS, MAKE_FX_KNOBS, COMPILE_KNOBS):
            if name in table:
                return self.knobs.get(name, table[name][0])
        raise KeyError(name)


_USER_VARIANTS: dict[str, Callable[..., Any]] = {}


def register_variant(name: str, builder: Callable[..., Any]) -> None:
    """Register a variant built by ``builder(ctx)``, which returns ``run(batch, weights)``.

    ``ctx`` is a ``gradprobe.build.VariantContext`` (the model, the step, the terms, the batch). ``run``
    must compute the loss through the model's own parameters (so gradients reach them) and return the
    total loss or ``(total, {term: value})``; ``weights`` maps each term to a 0-dim tensor.
    """
    if not name or re.search(r"[,\[\]\s]", name):
        raise SpecError(f"variant name {name!r} must be non-empty without commas, brackets or spaces")
    _USER_VARIANTS[name] = builder


def user_variant(name: str, builder: Callable[..., Any]) -> VariantSpec:
    """A variant object for a one-off builder, to pass in ``variants=[...]`` without registering."""
    return VariantSpec(name, capture="user", builder=builder)


_PART = re.compile(r"^(?P<head>[A-Za-z_][\w:.-]*?)(\[(?P<knobs>[^\]]*)\])?$")


def _parse_knobs(text: str | None, table: dict[str, tuple[Any, tuple[Any, ...] | None]], part: str) -> dict:
    knobs: dict[str, Any] = {}
    if not text:
        return knobs
    for item in text.split(","):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or key not in table:
            raise SpecError(
                f"unknown knob {key!r} for {part}{did_you_mean(key, table)}; knobs are: "
                + ", ".join(f"{k}={'|'.join(map(_spell, v[1] or ()))}" for k, v in table.items())
            )
        value = _value(raw.strip())
        allowed = table[key][1]
        if allowed is not None and value not in allowed:
            raise SpecError(
                f"knob {key}={raw.strip()} for {part}: allowed values are {'|'.join(map(_spell, allowed))}"
            )
        if value != table[key][0]:
            knobs[key] = value
    return knobs


def _value(raw: str) -> Any:
    lowered = raw.lower()
    return {"true": True, "false": False, "none": None}.get(lowered, raw)


def _spell(v: Any) -> str:
    return {True: "true", False: "false", None: "none"}.get(v, str(v)) if not isinstance(v, str) else v


def canonical_name(capture: str, backend: str | None, knobs: dict[str, Any]) -> str:
    """The short spelling, with only non-default knobs shown."""

    def part(head: str, table: dict) -> str:
        shown = [f"{k}={_spell(knobs[k])}" for k in table if k in knobs]
        return head + (f"[{','.join(shown)}]" if shown else "")

    step_table = {**STEP_KNOBS, **(MAKE_FX_KNOBS if capture == "make_fx" else {})}
    head = part("make_fx", step_table) if capture == "make_fx" else None
    if backend is None:
        return head or part(EAGER, STEP_KNOBS)
    tail = part(f"compile:{backend}", COMPILE_KNOBS if head else {**COMPILE_KNOBS, **STEP_KNOBS})
    return f"{head}+{tail}" if head else tail


def parse_variant(text: str) -> VariantSpec:
    """One variant from its spelling (see the module docstring)."""
    text = text.strip()
    if text in _USER_VARIANTS:
        return VariantSpec(text, capture="user", builder=_USER_VARIANTS[text])
    parts = text.split("+")
    if not 1 <= len(parts) <= 2:
        raise SpecError(f"variant {text!r}: at most one '+' (make_fx+compile:<backend>)")
    capture, backend, knobs = "eager", None, {}
    for i, raw in enumerate(parts):
        m = _PART.match(raw.strip())
        if m is None:
            raise SpecError(
                f"cannot read variant {text!r}: expected e.g. make_fx[detach=alias]+compile:aot_eager"
            )
        head, knob_text = m["head"], m["knobs"]
        if head == EAGER and len(parts) == 1:
            knobs.update(_parse_knobs(knob_text, STEP_KNOBS, head))
        elif head == "make_fx" and i == 0:
            capture = "make_fx"
            knobs.update(_parse_knobs(knob_text, {**STEP_KNOBS, **MAKE_FX_KNOBS}, head))
        elif head.startswith("compile:") and i == len(parts) - 1:
            backend = head.removeprefix("compile:")
            if backend not in BACKENDS and backend not in _registered_backends():
                raise SpecError(
                    f"unknown backend {backend!r}{did_you_mean(backend, BACKENDS)}; backends are: {', '.join(BACKENDS)}"
                )
            table = COMPILE_KNOBS if capture == "make_fx" else {**COMPILE_KNOBS, **STEP_KNOBS}
            knobs.update(_parse_knobs(knob_text, table, head))
        else:
            known = [EAGER, "make_fx", *(f"compile:{b}" for b in BACKENDS), *_USER_VARIANTS]
            raise SpecError(
                f"unknown variant {text!r}{did_you_mean(text, known)}; variants are: eager, make_fx, "
                f"compile:<backend>, make_fx+compile:<backend> (backends: {', '.join(BACKENDS)})"
                + (f", and registered: {', '.join(_USER_VARIANTS)}" if _USER_VARIANTS else "")
            )
    return VariantSpec(canonical_name(capture, backend, knobs), capture, backend, knobs)


def _registered_backends() -> list[str]:
    """Dynamo backends registered by name (custom ones included), looked up only for unknown names."""
    from torch._dynamo import list_backends

    return list(list_backends(exclude_tags=()))


def parse_variants(given: str | Sequence[str | VariantSpec]) -> list[VariantSpec]:
    """``"eager,make_fx"`` or a list of spellings / VariantSpec objects, validated and de-duplicated."""
    items = _split(given) if isinstance(given, str) else list(given)
    out: list[VariantSpec] = []
    for item in items:
        spec = item if isinstance(item, VariantSpec) else parse_variant(str(item))
        if spec.name in (v.name for v in out):
            raise SpecError(f"variant {spec.name!r} is listed twice")
        out.append(spec)
    if not out:
        raise SpecError("no variant to run: give at least one, e.g. variants='eager'")
    return out


def _split(text: str) -> list[str]:
    """Split on commas outside brackets."""
    items, depth, current = [], 0, ""
    for ch in text:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    items.append(current)
    return [i.strip() for i in items if i.strip()]
