"""The flow map: status and norm of every (variant, scenario, parameter), as plain, versioned data.

It is what every later stage (checks, locate, bisect, diagnose, reports) reads. It holds no tensors
and no references to the model: it can be saved with ``to_json`` and read back with ``from_json``
into an equal object. The JSON schema is documented in docs/flowmap-schema.md.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from .compare import VERDICTS
from .errors import FlowMapFormatError, did_you_mean
from .status import NONZERO, STATUSES

SCHEMA = "gradprobe.flowmap/1"
SEVERITIES = ("error", "warning", "info")


@dataclass(frozen=True)
class ParameterInfo:
    """One parameter tensor of the model (tied weights appear once, under their first name)."""

    name: str
    shape: tuple[int, ...]
    numel: int
    requires_grad: bool
    dtype: str
    device: str


@dataclass(frozen=True)
class ScenarioInfo:
    name: str
    terms: tuple[str, ...]


@dataclass(frozen=True)
class RunError:
    """Why one run (or one variant's build) failed: the stage it reached, the exception, the message."""

    stage: str  # build | trace | compile | forward | backward | reduce
    type: str
    message: str


@dataclass(frozen=True)
class VariantInfo:
    name: str
    knobs: dict[str, Any] = field(default_factory=dict)
    error: RunError | None = None
    compile_count: int | None = None  # runs in which the backend compiled a graph: 1 = compiled once
    seconds: float = 0.0
    capture: str = "eager"  # eager | make_fx | user
    backend: str | None = None
    graphs: int | None = None  # graphs handed to the backend (more than 1: graph breaks or recompiles)
    graph_breaks: int | None = None
    second_batch: dict[str, Any] | None = None  # comparison with the reference on a second batch
    graph: dict[str, Any] | None = None  # lint of the traced graph (graphlint.lint)


@dataclass(frozen=True)
class Run:
    """One (variant, scenario) measurement: the term values it saw and whether it failed."""

    variant: str
    scenario: str
    term_values: dict[str, float | None] = field(default_factory=dict)
    total: float | None = None
    error: RunError | None = None
    seconds: float = 0.0
    compiled_graphs: int | None = None  # graphs compiled during this run: > 0 after the first = recompiles


@dataclass(frozen=True)
class Cell:
    """The gradient of one parameter in one run. ``norm`` is the L1 norm (None when status is none).

    ``rel_error`` and ``verdict`` compare it with the reference variant's cell (None in the reference).
    """

    variant: str
    scenario: str
    parameter: str
    status: str
    norm: float | None
    rel_error: float | None = None
    verdict: str | None = None  # match | missing | extra | wrong


@dataclass(frozen=True)
class Finding:
    """One diagnosed problem: a cause from the catalogue, its evidence, where it is, and the fix."""

    cause: str
    severity: str  # error | warning | info
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)
    location: dict[str, Any] | None = None
    fix: str = ""
    references: tuple[str, ...] = ()


@dataclass(frozen=True, eq=False)
class FlowMap:
    """Result of a probe. Equality compares the serialised form (so NaN norms compare equal)."""

    torch_version: str
    device: str
    dtype: str
    mode: str
    terms: tuple[str, ...]
    scenarios: tuple[ScenarioInfo, ...]
    variants: tuple[VariantInfo, ...]
    runs: tuple[Run, ...]
    parameters: tuple[ParameterInfo, ...]
    cells: tuple[Cell, ...]
    findings: tuple[Finding, ...] = ()
    gradprobe_version: str = ""
    notes: dict[str, str] = field(default_factory=dict)
    reference: str = "eager"  # the variant others are compared with
    rtol: float | None = None  # relative L1 error above which a value counts as wrong
    warnings: tuple[str, ...] = ()
    bisections: tuple[dict[str, Any], ...] = ()  # bisect.Bisection.to_dict() per failing variant
    breaks: tuple[dict[str, Any], ...] = ()  # locate.Break.to_dict(): where chains break in the model
    checks: dict[str, Any] = field(default_factory=dict)  # verification results by check name (checks.py)
    schema: str = SCHEMA

    # ----- queries -------------------------------------------------------------------------------

    @cached_property
    def _index(self) -> dict[tuple[str, str], dict[str, Cell]]:
        index: dict[tuple[str, str], dict[str, Cell]] = {}
        for c in self.cells:
            index.setdefault((c.variant, c.scenario), {})[c.parameter] = c
        return index

    @property
    def variant_names(self) -> tuple[str, ...]:
        return tuple(v.name for v in self.variants)

    @property
    def scenario_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.scenarios)

    @property
    def trainable(self) -> tuple[str, ...]:
        """Names of the parameters that can receive a gradient (``requires_grad=True``)."""
        return tuple(p.name for p in self.parameters if p.requires_grad)

    def variant(self, name: str) -> VariantInfo:
        for v in self.variants:
            if v.name == name:
                return v
        raise KeyError(f"no variant {name!r}{did_you_mean(name, self.variant_names)}")

    def run(self, variant: str, scenario: str) -> Run:
        for r in self.runs:
            if r.variant == variant and r.scenario == scenario:
                return r
        raise KeyError(f"no run for variant {variant!r}, scenario {scenario!r}")

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

    def reached(self, variant: str, scenario: str) -> frozenset[str]:
        """Parameters with a non-zero, finite gradient in that run."""
        return frozenset(p for p, c in self.cells_of(variant, scenario).items() if c.status == NONZERO)

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

    # ----- serialisation -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d = {
            "schema": self.schema,
            "gradprobe_version": self.gradprobe_version,
            "torch_version": self.torch_version,
            "device": self.device,
            "dtype": self.dtype,
            "mode": self.mode,
            "terms": list(self.terms),
            "scenarios": [asdict(s) for s in self.scenarios],
            "variants": [asdict(v) for v in self.variants],
            "runs": [asdict(r) for r in self.runs],
            "parameters": [asdict(p) for p in self.parameters],
            "cells": [asdict(c) for c in self.cells],
            "findings": [asdict(f) for f in self.findings],
            "notes": dict(self.notes),
            "reference": self.reference,
            "rtol": self.rtol,
            "warnings": list(self.warnings),
            "bisections": list(self.bisections),
            "breaks": list(self.breaks),
            "checks": dict(self.checks),
        }
        return _json_safe(d)

    def to_json(self, path: str | os.PathLike[str] | None = None, *, indent: int | None = 1) -> str:
        """The flow map as JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=indent, allow_nan=False)
        if path is not None:
            Path(path).write_text(text + "\n", encoding="utf-8")
        return text

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FlowMap:
        if not isinstance(d, Mapping):
            raise FlowMapFormatError(f"a flow map is a JSON object, got {type(d).__name__}")
        schema = d.get("schema")
        if schema != SCHEMA:
            if isinstance(schema, str) and schema.startswith("gradprobe.flowmap/"):
                raise FlowMapFormatError(
                    f"flow map schema {schema!r} is not supported by this gradprobe (reads {SCHEMA!r}): "
                    "upgrade gradprobe to read it"
                )
            raise FlowMapFormatError(f"not a gradprobe flow map: schema is {schema!r}, expected {SCHEMA!r}")
        try:
            fm = cls(
                schema=schema,
                gradprobe_version=str(d.get("gradprobe_version", "")),
                torch_version=str(d["torch_version"]),
                device=str(d["device"]),
                dtype=str(d["dtype"]),
                mode=str(d["mode"]),
                terms=tuple(str(t) for t in d["terms"]),
                scenarios=tuple(ScenarioInfo(s["name"], tuple(s["terms"])) for s in d["scenarios"]),
                variants=tuple(
                    VariantInfo(
                        v["name"],
                        dict(v.get("knobs") or {}),
                        _error(v.get("error")),
                        v.get("compile_count"),
                        float(v.get("seconds", 0.0)),
                        str(v.get("capture", "eager")),
                        v.get("backend"),
                        v.get("graphs"),
                        v.get("graph_breaks"),
                        v.get("second_batch"),
                        v.get("graph"),
                    )
                    for v in d["variants"]
                ),
                runs=tuple(
                    Run(
                        r["variant"],
                        r["scenario"],
                        {k: _float(x) for k, x in (r.get("term_values") or {}).items()},
                        _float(r.get("total")),
                        _error(r.get("error")),
                        float(r.get("seconds", 0.0)),
                        r.get("compiled_graphs"),
                    )
                    for r in d["runs"]
                ),
                parameters=tuple(
                    ParameterInfo(
                        p["name"],
                        tuple(int(n) for n in p["shape"]),
                        int(p["numel"]),
                        bool(p["requires_grad"]),
                        str(p.get("dtype", "")),
                        str(p.get("device", "")),
                    )
                    for p in d["parameters"]
                ),
                cells=tuple(
                    Cell(
                        c["variant"],
                        c["scenario"],
                        c["parameter"],
                        _status(c["status"]),
                        _float(c.get("norm")),
                        _float(c.get("rel_error")),
                        _verdict(c.get("verdict")),
                    )
                    for c in d["cells"]
                ),
                findings=tuple(
                    Finding(
                        f["cause"],
                        _severity(f["severity"]),
                        f["message"],
                        dict(f.get("evidence") or {}),
                        f.get("location"),
                        f.get("fix", ""),
                        tuple(f.get("references") or ()),
                    )
                    for f in d.get("findings", [])
                ),
                notes=dict(d.get("notes") or {}),
                reference=str(d.get("reference", "eager")),
                rtol=_float(d.get("rtol")),
                warnings=tuple(str(w) for w in d.get("warnings") or ()),
                bisections=tuple(dict(b) for b in d.get("bisections") or ()),
                breaks=tuple(dict(b) for b in d.get("breaks") or ()),
                checks=dict(d.get("checks") or {}),
            )
        except FlowMapFormatError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise FlowMapFormatError(f"malformed flow map: {type(e).__name__}: {e}") from None
        return fm

    @classmethod
    def from_json(cls, source: str | os.PathLike[str]) -> FlowMap:
        """Read a flow map from JSON text or from a file path. Only JSON is ever parsed."""
        text = str(source)
        if isinstance(source, os.PathLike) or not text.lstrip().startswith(("{", "[")):
            try:
                text = Path(source).read_text(encoding="utf-8")
            except OSError as e:
                raise FlowMapFormatError(f"cannot read flow map {str(source)!r}: {e.strerror}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise FlowMapFormatError(f"flow map is not valid JSON: {e}") from None
        return cls.from_dict(data)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FlowMap):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]


# Non-finite floats travel as strings: strict JSON has no NaN or Infinity.
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x


def _float(x: Any) -> float | None:
    if x is None:
        return None
    if isinstance(x, str):
        if x not in _NONFINITE:
            raise FlowMapFormatError(f"expected a number, got the string {x!r}")
        return _NONFINITE[x]
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise FlowMapFormatError(f"expected a number, got {x!r}")
    return float(x)


def _status(s: Any) -> str:
    if s not in STATUSES:
        raise FlowMapFormatError(f"unknown status {s!r}; statuses are: {', '.join(STATUSES)}")
    return s


def _verdict(v: Any) -> str | None:
    if v is not None and v not in VERDICTS:
        raise FlowMapFormatError(f"unknown verdict {v!r}; verdicts are: {', '.join(VERDICTS)}")
    return v


def _severity(s: Any) -> str:
    if s not in SEVERITIES:
        raise FlowMapFormatError(f"unknown severity {s!r}; severities are: {', '.join(SEVERITIES)}")
    return s


def _error(e: Any) -> RunError | None:
    if e is None:
        return None
    return RunError(str(e["stage"]), str(e["type"]), str(e["message"]))


def parameter_infos(named: Iterable[tuple[str, Any]]) -> tuple[ParameterInfo, ...]:
    """ParameterInfo for each (name, parameter) pair."""
    return tuple(
        ParameterInfo(
            n, tuple(p.shape), p.numel(), p.requires_grad, str(p.dtype).removeprefix("torch."), str(p.device)
        )
        for n, p in named
    )
