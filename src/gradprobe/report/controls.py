"""Control characters made visible: text from a flow map (names, messages, code lines) may come from
an untrusted file, and a raw ESC, bell, carriage return or right-to-left override in it would drive
the reader's terminal (clear the screen, print a fake "OK", reorder what is shown).

Every renderer passes its whole output through ``visible``: gradprobe itself writes no control
character but newlines (and tabs from source lines), so everything else came from the data and is
shown escaped, as Python writes it (``\\x1b``, ``\\u202e``).
"""

from __future__ import annotations

import re

# C0 controls but tab and newline, DEL, C1 controls, and the Unicode controls that reorder or hide
# text (bidirectional marks, embeddings, overrides and isolates; line and paragraph separators).
_CONTROLS = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]"
)


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(text: str) -> str:
    """``text`` with every control character (but newline and tab) written as its escape."""
    return _CONTROLS.sub(_escaped, text)
