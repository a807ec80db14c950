"""Reference models with known answers: a small but real machine-learned interatomic potential.

``reference_spec()`` is what ``gradprobe demo`` probes.
"""

from .data import make_batch
from .loss import Prefactors, mlip_loss
from .potential import ReferencePotential
from .reference import REFERENCE_NOTES, reference_spec, terms_step, weights_step

__all__ = [
    "REFERENCE_NOTES",
    "Prefactors",
    "ReferencePotential",
    "make_batch",
    "mlip_loss",
    "reference_spec",
    "terms_step",
    "weights_step",
]
