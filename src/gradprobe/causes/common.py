"""Small helpers shared by detectors."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def module_of(parameter: str) -> str:
    """``fitting.layer1.bias`` -> ``fitting.layer1``; a top-level parameter is its own module ``''``."""
    return parameter.rpartition(".")[0]


def note_for(parameter: str, notes: Mapping[str, str]) -> str | None:
    """The user's note on why ``parameter`` may get no gradient: exact name first, then longest prefix."""
    if parameter in notes:
        return notes[parameter]
    best = max((p for p in notes if parameter.startswith(p.rstrip(".") + ".")), key=len, default=None)
    return notes[best] if best is not None else None


def names(items: Iterable[str], limit: int = 8) -> str:
    """'a, b, c' with '… and N more' past ``limit``."""
    items = list(items)
    shown = ", ".join(items[:limit])
    return shown + (f" … and {len(items) - limit} more" if len(items) > limit else "")
