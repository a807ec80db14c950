"""Variants: the ways of executing the same training step. Spelled ``eager``, and (next) ``make_fx``,
``compile:<backend>``, ``make_fx+compile:<backend>``; built once each and reused for every scenario."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import SpecError, did_you_mean

EAGER = "eager"
BUILTIN = (EAGER,)


@dataclass(frozen=True)
class VariantSpec:
    """A variant's name and the knobs it is built under."""

    name: str
    knobs: dict[str, Any] = field(default_factory=dict)


def parse_variants(given: str | Sequence[str | VariantSpec]) -> list[VariantSpec]:
    """``"eager,make_fx"`` or a list of names / VariantSpec objects, validated and de-duplicated."""
    items = [s.strip() for s in given.split(",")] if isinstance(given, str) else list(given)
    out: list[VariantSpec] = []
    for item in items:
        spec = item if isinstance(item, VariantSpec) else VariantSpec(str(item))
        if spec.name not in BUILTIN:
            raise SpecError(
                f"unknown variant {spec.name!r}{did_you_mean(spec.name, BUILTIN)}; variants are: "
                f"{', '.join(BUILTIN)}"
            )
        if spec.name in (v.name for v in out):
            raise SpecError(f"variant {spec.name!r} is listed twice")
        out.append(spec)
    if not out:
        raise SpecError("no variant to run: give at least one, e.g. variants='eager'")
    return out
