"""gradprobe: which parameters does each loss term reach, in eager and compiled training, and why not.

>>> import gradprobe
>>> fm = gradprobe.probe(model, step, batch)        # doctest: +SKIP
>>> print(gradprobe.render(fm))                     # doctest: +SKIP
"""

__version__ = "0.1.0"

from .errors import FlowMapFormatError, GradProbeError, SpecError, StepContractError
from .flowmap import Cell, Finding, FlowMap, Run, RunError
from .probe import probe
from .report.terminal import render
from .scenarios import Scenario
from .spec import ProbeSpec
from .status import STATUSES

__all__ = [
    "STATUSES",
    "Cell",
    "Finding",
    "FlowMap",
    "FlowMapFormatError",
    "GradProbeError",
    "ProbeSpec",
    "Run",
    "RunError",
    "Scenario",
    "SpecError",
    "StepContractError",
    "__version__",
    "probe",
    "render",
]
