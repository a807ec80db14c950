"""Words shared by the stages that describe evidence: the collectors' summaries, the detectors'
messages and the renderers' lines. Reads strings only; imports nothing from gradprobe."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def names(items: Iterable[str], limit: int = 8) -> str:
    """'a, b, c' with '… and N more' past ``limit``."""
    items = list(items)
    shown = ", ".join(items[:limit])
    return shown + (f" … and {len(items) - limit} more" if len(items) > limit else "")


def rank_list(ranks: Iterable[int]) -> str:
    """'0, 2' for ranks 0 and 2; 'none' for no rank."""
    return ", ".join(str(r) for r in ranks) or "none"


def op_name(info: Any) -> str:
    """``<OpOverload(op='aten.native_dropout', overload='default')>`` -> ``aten.native_dropout``."""
    text = str(info or "")
    if "op='" in text:
        return text.split("op='", 1)[1].split("'", 1)[0]
    return text[:120]
