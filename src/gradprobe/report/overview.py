"""The first screen of a report: one line per finding, in the diagnosis order (``fm.findings``), with
duplicates merged: findings of the same cause and severity whose headlines read the same (once the
variant each names is set aside) become one line that names every path and scenario they cover."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..flowmap import Finding, FlowMap

HEADLINE_MIN = 40  # a headline takes the message's ": "-separated parts until it is at least this long
HEADLINE_MAX = 150  # and is cut at a word boundary past this
_CUT = re.compile(r"; | — ")
_COLON = re.compile(r": ")


@dataclass
class Line:
    """One first-screen line: the findings it stands for (indices into ``fm.findings``)."""

    severity: str
    cause: str
    headline: str
    indices: list[int] = field(default_factory=list)
    variants: list[str] = field(default_factory=list)
    scenarios: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        """The headline, with the paths it covers when several findings were merged into it."""
        if len(self.variants) < 2:
            return self.headline
        if self.variants[0] in self.headline:
            return self.headline.replace(self.variants[0], ", ".join(self.variants), 1)
        return f"{self.headline} (in {', '.join(self.variants)})"


def _split(text: str, pattern: re.Pattern[str]) -> list[str]:
    """``text`` split where ``pattern`` matches outside parentheses and brackets."""
    parts, start, depth, pos = [], 0, 0, 0
    while pos < len(text):
        c = text[pos]
        depth += (c in "([") - (c in ")]")
        m = pattern.match(text, pos) if depth <= 0 else None
        if m and m.end() > pos:
            parts.append(text[start:pos])
            start = pos = m.end()
            continue
        pos += 1
    return [*parts, text[start:]]


def headline(message: str) -> str:
    """The first clause of a finding's message: its ``: ``-separated parts until ``HEADLINE_MIN``
    characters, up to the first ``; `` or `` — `` (outside parentheses), at most ``HEADLINE_MAX``
    characters."""
    out = ""
    for part in _split(message, _COLON):
        out = f"{out}: {part}" if out else part
        if len(out) >= HEADLINE_MIN:
            break
    out = _split(out, _CUT)[0].strip()
    if len(out) > HEADLINE_MAX:
        out = out[:HEADLINE_MAX].rsplit(" ", 1)[0].rstrip(",;:") + " …"
    return out


def _variant(f: Finding) -> str | None:
    v = f.evidence.get("variant") or (f.location or {}).get("variant")
    return str(v) if v else None


def _scenarios(f: Finding) -> list[str]:
    s = f.evidence.get("scenarios") or ([f.evidence["scenario"]] if f.evidence.get("scenario") else [])
    return [str(x) for x in s] if isinstance(s, list | tuple) else []


def finding_lines(fm: FlowMap) -> list[Line]:
    """One ``Line`` per distinct finding, in the order of ``fm.findings``."""
    lines: dict[tuple[str, str, str], Line] = {}
    for i, f in enumerate(fm.findings):
        text, variant = headline(f.message), _variant(f)
        key_text = text.replace(variant, "\0") if variant else text
        line = lines.setdefault((f.severity, f.cause, key_text), Line(f.severity, f.cause, text))
        line.indices.append(i)
        if variant and variant not in line.variants:
            line.variants.append(variant)
        line.scenarios += [s for s in _scenarios(f) if s not in line.scenarios]
    return list(lines.values())
