"""The flow map: status and norm of every (variant, scenario, parameter), as plain, versioned data.

Every later stage (checks, locate, bisect, diagnose, reports) reads it. It holds no tensors and no
references to the model; ``to_json`` saves it, ``from_json`` reads it back equal (docs/flowmap-schema.md).
The records are frozen msgspec Structs: made ten times faster than frozen dataclasses (a large model's
probe makes tens of thousands of cells), and the types a saved map is decoded into (flowmap_read.py).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from .errors import did_you_mean
from .status import NONZERO

SCHEMA = "gradprobe.flowmap/1"
MAX_BYTES = 256 * 2**20  # about a million cells (50,000 parameter tensors x 20 runs) at ~250 bytes each
MAX_BYTES_ENV = "GRADPROBE_FLOWMAP_MAX_BYTES"
MAX_DEPTH = 64  # gradprobe writes at most about 8 levels; deeper input would only strain recursion

Status = Literal["none", "zero", "nonzero", "nan", "inf"]  # status.STATUSES
Verdict = Literal["match", "missing", "extra", "wrong"]  # compare.VERDICTS
Severity = Literal["error", "warning", "info"]
Mode = Literal["terms", "weights"]
Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]  # sizes and counts: int64 in torch


class ParameterInfo(msgspec.Struct, frozen=True, gc=False):
    """One parameter tensor of the model (tied weights appear once, under their first name)."""

    name: str
    shape: tuple[Count, ...]
    numel: Count
    requires_grad: bool
    dtype: str
    device: str


class ScenarioInfo(msgspec.Struct, frozen=True, gc=False):
    name: str
    terms: tuple[str, ...]


class RunError(msgspec.Struct, frozen=True):
    """Why one run (or one variant's build) failed: the stage it reached, the exception, the message."""

    stage: str  # build | trace | compile | forward | backward | reduce
    type: str
    message: str
    # The user's frame the failure came from: {file, line, code, function} (the innermost frame
    # outside torch and gradprobe, or the "from user code" frame dynamo names), None if unknown;
    # with ``object_type`` when that frame is a method (the type of its ``self``).
    where: dict[str, Any] | None = None
    # The innermost traceback frames, torch's included ("runtime_wrappers.py:2489 in
    # coerce_to_expected_memory_format"), innermost last: what a failure signature is read from.
    frames: tuple[str, ...] = ()


class VariantInfo(msgspec.Struct, frozen=True):
    name: str
    knobs: dict[str, Any] = {}
    error: RunError | None = None
    compile_count: Count | None = None  # runs in which the backend compiled a graph: 1 = compiled once
    seconds: float = 0.0
    capture: str = "eager"  # eager | make_fx | user
    backend: str | None = None
    graphs: Count | None = None  # graphs handed to the backend (more than 1: graph breaks or recompiles)
    graph_breaks: Count | None = None
    second_batch: dict[str, Any] | None = None  # comparison with the reference on a second batch
    graph: dict[str, Any] | None = None  # lint of the traced graph (graphlint.lint)


class Run(msgspec.Struct, frozen=True):
    """One (variant, scenario) measurement: the term values it saw and whether it failed."""

    variant: str
    scenario: str
    term_values: dict[str, float | None] = {}
    total: float | None = None
    error: RunError | None = None
    seconds: float = 0.0
    compiled_graphs: Count | None = None  # graphs compiled during this run: > 0 after the first = recompiles
    # Against the reference's gradients of the same scenario, over all parameters at once:
    grad_cosine: float | None = None  # cosine of the two gradient vectors
    grad_scale: float | None = None  # |g|_2 / |g_ref|_2
    metrics: dict[str, float | None] = {}  # a trainer's rmse etc. (not trained)


class Cell(msgspec.Struct, frozen=True, gc=False):
    """The gradient of one parameter in one run. ``norm`` is the L1 norm (None when status is none).

    ``rel_error`` and ``verdict`` compare it with the reference variant's cell (None in the reference).
    """

    variant: str
    scenario: str
    parameter: str
    status: Status
    norm: float | None
    rel_error: float | None = None
    verdict: Verdict | None = None


class Finding(msgspec.Struct, frozen=True):
    """One diagnosed problem: a cause from the catalogue, its evidence, where it is, and the fix."""

    cause: str
    severity: Severity
    message: str
    evidence: dict[str, Any] = {}
    location: dict[str, Any] | None = None
    fix: str = ""
    references: tuple[str, ...] = ()


class FlowMap(msgspec.Struct, frozen=True, dict=True, eq=False):
    """Result of a probe. Equality compares the serialised form (so NaN norms compare equal). Queries
    are computed once and kept (``cached_property``, in the ``__dict__`` that ``dict=True`` gives)."""

    torch_version: str
    device: str
    dtype: str
    mode: Mode
    terms: tuple[str, ...]
    scenarios: tuple[ScenarioInfo, ...]
    variants: tuple[VariantInfo, ...]
    runs: tuple[Run, ...]
    parameters: tuple[ParameterInfo, ...]
    cells: tuple[Cell, ...]
    findings: tuple[Finding, ...] = ()
    gradprobe_version: str = ""
    notes: dict[str, str] = {}
    # the spec's expect=, normalised: {scenario: {"reaches": [prefix, ...], "not_reaches": [...]}}
    expect: dict[str, dict[str, list[str]]] = {}
    reference: str = "eager"  # the variant others are compared with
    rtol: float | None = None  # relative L1 error above which a value counts as wrong
    warnings: tuple[str, ...] = ()
    bisections: tuple[dict[str, Any], ...] = ()  # bisect.Bisection.to_dict() per failing variant
    breaks: tuple[dict[str, Any], ...] = ()  # locate.Break.to_dict(): where chains break in the model
    checks: dict[str, Any] = {}  # verification results by check name (checks.py)
    # What the evidence layer gathered (gradprobe.evidence): lineage, confirmations, dynamo events.
    evidence: dict[str, Any] = {}
    schema: str = SCHEMA

    __hash__ = None  # type: ignore[assignment]  # mutable dicts inside, equality by value

    @cached_property
    def _index(self) -> dict[tuple[str, str], dict[str, Cell]]:
        index: dict[tuple[str, str], dict[str, Cell]] = {}
        for c in self.cells:
            index.setdefault((c.variant, c.scenario), {})[c.parameter] = c
        return index

    @cached_property
    def variant_names(self) -> tuple[str, ...]:
        return tuple(v.name for v in self.variants)

    @cached_property
    def scenario_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.scenarios)

    @cached_property
    def _runs(self) -> dict[tuple[str, str], Run]:
        return {(r.variant, r.scenario): r for r in reversed(self.runs)}  # the first, as a scan would find

    @cached_property
    def trainable(self) -> tuple[str, ...]:
        """Names of the parameters that can receive a gradient (``requires_grad=True``)."""
        return tuple(p.name for p in self.parameters if p.requires_grad)

    @cached_property
    def trainable_set(self) -> frozenset[str]:
        """``trainable`` as a set, for membership tests (a flow map may hold 100,000 parameters)."""
        return frozenset(self.trainable)

    def variant(self, name: str) -> VariantInfo:
        for v in self.variants:
            if v.name == name:
                return v
        raise KeyError(f"no variant {name!r}{did_you_mean(name, self.variant_names)}")

    def run(self, variant: str, scenario: str) -> Run:
        found = self._runs.get((variant, scenario))
        if found is None:
            raise KeyError(f"no run for variant {variant!r}, scenario {scenario!r}")
        return found

    def cells_of(self, variant: str, scenario: str) -> dict[str, Cell]:
        """Cells of one run by parameter name (empty when the run failed)."""
        return self._index.get((variant, scenario), {})

    def cell(self, variant: str, scenario: str, parameter: str) -> Cell:
        try:
            return self._index[(variant, scenario)][parameter]
        except KeyError:
            raise KeyError(f"no cell for ({variant!r}, {scenario!r}, {parameter!r})") from None

    def statuses(self, variant: str, scenario: str) -> dict[str, str]:
        return {p: c.status for p, c in self.cells_of(variant, scenario).items()}

    @cached_property
    def _by_status(self) -> dict[tuple[str, str], dict[str, list[str]]]:
        """Per run, the parameters of each status in cell order (several detectors ask which
        parameters are non-finite or reached, for thousands of parameters)."""
        out: dict[tuple[str, str], dict[str, list[str]]] = {}
        for run, cells in self._index.items():
            groups: dict[str, list[str]] = out.setdefault(run, {})
            for p, c in cells.items():
                groups.setdefault(c.status, []).append(p)
        return out

    def with_status(self, variant: str, scenario: str, *statuses: str) -> list[str]:
        """Parameters of that run whose status is one of ``statuses``, in cell order (ordered by
        status first when several are given)."""
        groups = self._by_status.get((variant, scenario), {})
        return [p for st in statuses for p in groups.get(st, ())]

    def reached(self, variant: str, scenario: str) -> frozenset[str]:
        """Parameters with a non-zero, finite gradient in that run."""
        return frozenset(self.with_status(variant, scenario, NONZERO))

    def count(self, variant: str, scenario: str) -> tuple[int, int]:
        """(reached, trainable) for that run; the pair the summary table shows as ``17/19``."""
        return len(self.reached(variant, scenario)), len(self.trainable)

    def differences(self, variant: str, scenario: str) -> dict[str, Cell]:
        """Cells of that run whose verdict against the reference is not ``match``."""
        return {p: c for p, c in self.cells_of(variant, scenario).items() if c.verdict not in (None, "match")}

    def bisection(self, variant: str) -> dict[str, Any] | None:
        return next((b for b in self.bisections if b.get("variant") == variant), None)

    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def exit_code(self) -> int:
        """1 when a finding has severity error, else 0 (the CLI's exit status)."""
        return 1 if self.errors() else 0

    def to_dict(self) -> dict[str, Any]:
        """The map as JSON values (records as objects, tuples as lists), non-finite numbers as the
        strings "nan", "inf", "-inf": strict JSON has none."""
        d = _json_safe(self)
        return {"schema": d.pop("schema"), "gradprobe_version": d.pop("gradprobe_version"), **d}

    def to_json(self, path: str | os.PathLike[str] | None = None, *, indent: int | None = 1) -> str:
        """The flow map as JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=indent, allow_nan=False)
        if path is not None:
            Path(path).write_text(text + "\n", encoding="utf-8")
        return text

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FlowMap:
        """A flow map from its ``to_dict()`` form, validated. Anything else (another schema, a newer
        version, a missing field, a value of the wrong type anywhere, nesting deeper than ``MAX_DEPTH``)
        raises one ``FlowMapFormatError`` naming the field. Unknown fields are ignored (later versions add)."""
        from .flowmap_read import from_data

        return from_data(d)

    @classmethod
    def from_json(cls, source: str | os.PathLike[str], *, max_bytes: int | None = None) -> FlowMap:
        """Read a flow map from JSON text or from a file path. Only JSON is ever parsed, nothing is
        unpickled or imported. A file larger than ``max_bytes`` (default ``MAX_BYTES``, 256 MiB, or the
        environment variable ``GRADPROBE_FLOWMAP_MAX_BYTES``) is refused before it is read. Every problem
        raises one ``FlowMapFormatError``; for a file, its message starts with the file's path."""
        from .flowmap_read import from_json

        return from_json(source, max_bytes)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FlowMap):
            return NotImplemented
        return self.to_dict() == other.to_dict()


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, msgspec.Struct):
        return {k: _json_safe(v) for k, v in msgspec.structs.asdict(x).items()}
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x
