"""The exceptions gradprobe raises. Each docstring says what to do about it.

A *bad input* (a non-scalar term, an unknown term name, a model without parameters) raises one of
these. A *symptom* (a term with no gradient path, a variant that fails to compile) is never raised:
it is recorded in the flow map as a run error.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class GradProbeError(Exception):
    """Root of every error gradprobe raises on purpose. The message says what to change."""


class SpecError(GradProbeError):
    """The spec (model, batch, step, terms, scenarios) is not usable as given: fix the named field."""


class StepContractError(GradProbeError):
    """The step returned something other than its declared contract: see the message for the
    expected form (terms mode: dict of scalar tensors; weights mode: one scalar tensor)."""


class FlowMapFormatError(GradProbeError):
    """A saved flow map could not be read: wrong schema, unsupported version, or malformed JSON."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """' (did you mean 'force'?)' when a close match exists, else ''."""
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
