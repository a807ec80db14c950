"""Variants: the ways of executing the same training step, and their short spelling.

    eager                         the user's step as written
    make_fx                       the step traced by make_fx (autograd.grad inside becomes plain ops)
    compile:<backend>             torch.compile of the whole step, loss and forces included (eager,
                                  aot_eager, aot_eager_decomp_partition, inductor)
    compile_model:<backend>       torch.compile of the model only; the step's loss and autograd.grad run
                                  eagerly around it (what most users write: ``model = torch.compile(model)``)
    make_fx+compile:<backend>     the traced graph, compiled (the pattern used for force training)

Knobs go in brackets after the part they belong to, e.g.
``make_fx[detach=alias,mode=eval]+compile:aot_eager[dynamic=true]``; ``compile_model:aot_eager[donated_buffer=false]``
measures what turning AOTAutograd's donated buffers off exposes (not with inductor). Users register their own variants
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
    # AOTAutograd's donated buffers (torch._functorch.config.donated_buffer), set for the build and every
    # run and restored after. Off only with backends that share no inductor cache (see parse_variant).
    "donated_buffer": (True, (True, False)),
}
# Turning donation off against inductor's shared cache gave silently wrong gradients (an inductor
# backward compiled with donated buffers, then run with donated_buffer=False): refused.
NO_DONATION_BACKENDS = ("eager", "aot_eager", "aot_eager_decomp_partition")


@dataclass(frozen=True)
class VariantSpec:
    """One variant: how the step is captured, which backend compiles it, and the knobs.

    ``builder`` is set for user variants: ``builder(ctx) -> run(batch, weights)`` (or a
    ``gradprobe.build.Built``); their knobs are declared in ``user_knobs`` (``{name: (default,
    allowed values)}``), reach the builder as ``ctx.knobs``, and can be flipped by the bisector.
    """

    name: str
    capture: str = (
        "eager"  # eager | make_fx | user | model (compile_model: the module compiled, not the step)
    )
    backend: str | None = None
    knobs: dict[str, Any] = field(default_factory=dict)
    builder: Callable[..., Any] | None = None
    user_knobs: dict[str, tuple[Any, tuple[Any, ...]]] = field(default_factory=dict)
    base: str = ""  # a user variant's name without knobs

    @property
    def compiled(self) -> bool:
        return self.backend is not None

    @property
    def traced(self) -> bool:
        """Built from a capture of the step (may freeze trace-time values or shapes)."""
        return self.capture != "eager" or self.backend is not None

    def knob(self, name: str) -> Any:
        if name in self.user_knobs:
            return self.knobs.get(name, self.user_knobs[name][0])
        for table in (STEP_KNOBS, MAKE_FX_KNOBS, COMPILE_KNOBS):
            if name in table:
                return self.knobs.get(name, table[name][0])
        raise KeyError(name)


KnobTable = dict[str, tuple[Any, tuple[Any, ...]]]
_USER_VARIANTS: dict[str, tuple[Callable[..., Any], KnobTable]] = {}


def _check_user_name(name: str) -> None:
    if not name or re.search(r"[,\[\]\s+]", name):
        raise SpecError(f"variant name {name!r} must be non-empty without commas, brackets, '+' or spaces")


def register_variant(name: str, builder: Callable[..., Any], knobs: KnobTable | None = None) -> None:
    """Register a variant built by ``builder(ctx)``, which returns ``run(batch, weights)``.

    ``ctx`` is a ``gradprobe.build.VariantContext`` (the model, the step, the terms, the batch, and
    ``ctx.knobs``). ``run`` must compute the loss through the model's own parameters (so gradients
    reach them) and return the total loss or ``(total, {term: value})``; ``weights`` maps each term to
    a 0-dim tensor. The builder may instead return a ``gradprobe.build.Built`` carrying, besides
    ``run``, a compile counter (proof that compiled code ran) and the traced graph (for the graph lint).
    ``knobs`` declares the variant's own knobs, ``{name: (default, allowed values)}``: they are spelled
    ``name[knob=value]`` and the bisector flips them one at a time.
    """
    _check_user_name(name)
    _USER_VARIANTS[name] = (builder, dict(knobs or {}))


def user_variant(
    name: str, builder: Callable[..., Any], knobs: KnobTable | None = None, **values: Any
) -> VariantSpec:
    """A variant object for a one-off builder, to pass in ``variants=[...]`` without registering.
    ``knobs`` declares its knobs (see ``register_variant``); ``values`` sets some of them."""
    _check_user_name(name)
    table = dict(knobs or {})
    for key, value in values.items():
        if key not in table:
            raise SpecError(f"unknown knob {key!r} for {name}{did_you_mean(key, table)}")
        if value not in table[key][1]:
            raise SpecError(f"knob {key}={spell(value)} for {name}: allowed values are "
                            f"{'|'.join(map(spell, table[key][1]))}")  # fmt: skip
    return with_user_knobs(VariantSpec(name, capture="user", builder=builder, user_knobs=table, base=name),
                           **values)  # fmt: skip


def with_user_knobs(v: VariantSpec, **changes: Any) -> VariantSpec:
    """A user variant with some knobs changed; only non-default values are kept and spelled."""
    base = v.base or v.name
    merged = {**v.knobs, **changes}
    knobs = {k: val for k, val in merged.items() if k in v.user_knobs and val != v.user_knobs[k][0]}
    shown = [f"{k}={spell(knobs[k])}" for k in v.user_knobs if k in knobs]
    name = base + (f"[{','.join(shown)}]" if shown else "")
    return VariantSpec(
        name, capture="user", knobs=knobs, builder=v.builder, user_knobs=v.user_knobs, base=base
    )


# One part of a spelling: a head and its bracketed knobs, ``make_fx[detach=alias]``.
PART = re.compile(r"^(?P<head>[A-Za-z_][\w:.-]*?)(\[(?P<knobs>[^\]]*)\])?$")


def parse_knobs(text: str | None, table: dict[str, tuple[Any, tuple[Any, ...] | None]], part: str) -> dict:
    """``"detach=alias,mode=train"`` read against ``table`` (knob: (default, allowed values)), defaults left
    out; an unknown knob or value of ``part`` is a ``SpecError``."""
    knobs: dict[str, Any] = {}
    if not text:
        return knobs
    for item in text.split(","):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or key not in table:
            raise SpecError(
                f"unknown knob {key!r} for {part}{did_you_mean(key, table)}; knobs are: "
                + ", ".join(f"{k}={'|'.join(map(spell, v[1] or ()))}" for k, v in table.items())
            )
        allowed = table[key][1]
        value = next((a for a in allowed or () if spell(a).lower() == raw.strip().lower()), None)
        value = value if value is not None else _value(raw.strip())
        if allowed is not None and value not in allowed:
            raise SpecError(
                f"knob {key}={raw.strip()} for {part}: allowed values are {'|'.join(map(spell, allowed))}"
            )
        if value != table[key][0]:
            knobs[key] = value
    return knobs


def _value(raw: str) -> Any:
    lowered = raw.lower()
    return {"true": True, "false": False, "none": None}.get(lowered, raw)


def spell(v: Any) -> str:
    """A knob value as it is spelt: ``true``, ``false``, ``none`` or the value."""
    if v is True or v is False or v is None:
        return str(v).lower()
    return str(v)


def canonical_name(capture: str, backend: str | None, knobs: dict[str, Any]) -> str:
    """The short spelling, with only non-default knobs shown."""

    def part(head: str, table: dict) -> str:
        shown = [f"{k}={spell(knobs[k])}" for k in table if k in knobs]
        return head + (f"[{','.join(shown)}]" if shown else "")

    step_table = {**STEP_KNOBS, **(MAKE_FX_KNOBS if capture == "make_fx" else {})}
    head = part("make_fx", step_table) if capture == "make_fx" else None
    if backend is None:
        return head or part(EAGER, STEP_KNOBS)
    if capture == "model":
        return part(f"compile_model:{backend}", {**COMPILE_KNOBS, **STEP_KNOBS})
    tail = part(f"compile:{backend}", COMPILE_KNOBS if head else {**COMPILE_KNOBS, **STEP_KNOBS})
    return f"{head}+{tail}" if head else tail


def parse_variant(text: str) -> VariantSpec:
    """One variant from its spelling (see the module docstring)."""
    text = text.strip()
    m = PART.match(text)
    if m is not None and m["head"] in _USER_VARIANTS:
        builder, table = _USER_VARIANTS[m["head"]]
        return user_variant(m["head"], builder, table, **parse_knobs(m["knobs"], table, m["head"]))
    parts = text.split("+")
    if not 1 <= len(parts) <= 2:
        raise SpecError(f"variant {text!r}: at most one '+' (make_fx+compile:<backend>)")
    capture, backend, knobs = "eager", None, {}
    for i, raw in enumerate(parts):
        m = PART.match(raw.strip())
        if m is None:
            raise SpecError(
                f"cannot read variant {text!r}: expected e.g. make_fx[detach=alias]+compile:aot_eager"
            )
        head, knob_text = m["head"], m["knobs"]
        if head == EAGER and len(parts) == 1:
            knobs.update(parse_knobs(knob_text, STEP_KNOBS, head))
        elif head == "make_fx" and i == 0:
            capture = "make_fx"
            knobs.update(parse_knobs(knob_text, {**STEP_KNOBS, **MAKE_FX_KNOBS}, head))
        elif head.startswith("compile_model:") and len(parts) == 1:
            capture, backend = "model", head.removeprefix("compile_model:")
            if backend not in BACKENDS and backend not in _registered_backends():
                raise SpecError(
                    f"unknown backend {backend!r}{did_you_mean(backend, BACKENDS)}; backends are: {', '.join(BACKENDS)}"
                )
            knobs.update(parse_knobs(knob_text, {**COMPILE_KNOBS, **STEP_KNOBS}, head))
        elif head.startswith("compile:") and i == len(parts) - 1:
            backend = head.removeprefix("compile:")
            if backend not in BACKENDS and backend not in _registered_backends():
                raise SpecError(
                    f"unknown backend {backend!r}{did_you_mean(backend, BACKENDS)}; backends are: {', '.join(BACKENDS)}"
                )
            table = COMPILE_KNOBS if capture == "make_fx" else {**COMPILE_KNOBS, **STEP_KNOBS}
            knobs.update(parse_knobs(knob_text, table, head))
        else:
            known = [EAGER, "make_fx", *(f"compile:{b}" for b in BACKENDS), *(f"compile_model:{b}" for b in BACKENDS),
                     *_USER_VARIANTS]  # fmt: skip
            raise SpecError(
                f"unknown variant {text!r}{did_you_mean(text, known)}; variants are: eager, make_fx, "
                f"compile:<backend>, compile_model:<backend>, make_fx+compile:<backend> (backends: {', '.join(BACKENDS)})"
                + (f", and registered: {', '.join(_USER_VARIANTS)}" if _USER_VARIANTS else "")
            )
    if knobs.get("donated_buffer") is False and backend not in NO_DONATION_BACKENDS:
        raise SpecError(
            f"variant {text!r}: donated_buffer=false only with the {', '.join(NO_DONATION_BACKENDS)} backends: "
            "against inductor's shared cache a backward compiled with donated buffers then ran without them "
            "and gave silently wrong gradients"
        )
    return VariantSpec(canonical_name(capture, backend, knobs), capture, backend, knobs)


def _registered_backends() -> list[str]:
    """Dynamo backends registered by name (custom ones included), looked up only for unknown names."""
    from torch._dynamo import list_backends

    return list(list_backends(exclude_tags=()))


def parse_variants(given: str | Sequence[str | VariantSpec]) -> list[VariantSpec]:
    """``"eager,make_fx"`` or a list of spellings / VariantSpec objects, validated and de-duplicated."""
    if given == EAGER and EAGER not in _USER_VARIANTS:  # the default, spelled out without a parse
        return [VariantSpec(EAGER)]
    items = split_spellings(given) if isinstance(given, str) else list(given)
    out: list[VariantSpec] = []
    for item in items:
        spec = item if isinstance(item, VariantSpec) else parse_variant(str(item))
        if spec.name in (v.name for v in out):
            raise SpecError(f"variant {spec.name!r} is listed twice")
        out.append(spec)
    if not out:
        raise SpecError("no variant to run: give at least one, e.g. variants='eager'")
    return out


def split_spellings(text: str) -> list[str]:
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
