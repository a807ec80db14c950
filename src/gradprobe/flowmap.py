"""The flow map: status and norm of every (variant, scenario, parameter), as plain, versioned data.

It is what every later stage (checks, locate, bisect, diagnose, reports) reads. It holds no tensors
and no references to the model: it can be saved with ``to_json`` and read back with ``from_json``
into an equal object. The JSON schema is documented in docs/flowmap-schema.md.
"""

from __future__ import annotations

import json
import math
import operator
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from itertools import chain, compress, repeat
from pathlib import Path
from typing import Any

from .compare import VERDICTS
from .errors import FlowMapFormatError, did_you_mean
from .status import NONZERO, STATUSES

SCHEMA = "gradprobe.flowmap/1"
SEVERITIES = ("error", "warning", "info")


@dataclass(frozen=True, slots=True)
class ParameterInfo:
    """One parameter tensor of the model (tied weights appear once, under their first name)."""

    name: str
    shape: tuple[int, ...]
    numel: int
    requires_grad: bool
    dtype: str
    device: str


@dataclass(frozen=True, slots=True)
class ScenarioInfo:
    name: str
    terms: tuple[str, ...]


@dataclass(frozen=True)
class RunError:
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


@dataclass(frozen=True, slots=True)
class Run:
    """One (variant, scenario) measurement: the term values it saw and whether it failed."""

    variant: str
    scenario: str
    term_values: dict[str, float | None] = field(default_factory=dict)
    total: float | None = None
    error: RunError | None = None
    seconds: float = 0.0
    compiled_graphs: int | None = None  # graphs compiled during this run: > 0 after the first = recompiles
    # Against the reference's gradients of the same scenario, over all parameters at once:
    grad_cosine: float | None = None  # cosine of the two gradient vectors
    grad_scale: float | None = None  # |g|_2 / |g_ref|_2
    metrics: dict[str, float | None] = field(default_factory=dict)  # a trainer's rmse etc. (not trained)


@dataclass(frozen=True, slots=True)
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


class _cached:  # noqa: N801 (a decorator, spelled as functools' cached_property it stands for)
    """``functools.cached_property`` without its lock (Python 3.11 takes an RLock on every first
    access, a microsecond each; a flow map's queries are pure, so two threads computing one at once
    would store equal values). The value is stored in the instance's ``__dict__``, which then shadows
    this non-data descriptor."""

    def __init__(self, func: Any) -> None:
        self.func = func
        self.name = func.__name__
        self.__doc__ = func.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.func(obj)
        return value


class CellBlock:
    """The cells of one run, or of a run's frozen parameters, as columns: what a probe measured, kept
    as it came (lists), a ``Cell`` made of each row only when someone asks (``Cells``)."""

    __slots__ = ("names", "norms", "rel_errors", "scenario", "statuses", "variant", "verdicts")

    def __init__(
        self,
        variant: str,
        scenario: str,
        names: Sequence[str],
        statuses: Sequence[str],
        norms: Sequence[float | None],
        rel_errors: Sequence[float | None] | None = None,
        verdicts: Sequence[str | None] | None = None,
    ) -> None:
        self.variant = variant
        self.scenario = scenario
        self.names = names
        self.statuses = statuses
        self.norms = norms
        self.rel_errors = rel_errors
        self.verdicts = verdicts

    def cells(self) -> Iterator[Cell]:
        """The rows as ``Cell`` objects, made at C speed (``map`` over the columns)."""
        return map(
            _make_cell,
            repeat(self.variant),
            repeat(self.scenario),
            self.names,
            self.statuses,
            self.norms,
            repeat(None) if self.rel_errors is None else self.rel_errors,
            repeat(None) if self.verdicts is None else self.verdicts,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            CellBlock,
            (
                self.variant,
                self.scenario,
                self.names,
                self.statuses,
                self.norms,
                self.rel_errors,
                self.verdicts,
            ),
        )


class _Lazy(Sequence[Any]):
    """A tuple made on first use: iteration, ``len``, indexing and slicing, ``+`` with a tuple either
    way, equality with a tuple. Subclasses keep columns and say how to make the items (``_make``)."""

    __slots__ = ("_made",)

    def __init__(self) -> None:
        self._made: tuple[Any, ...] | None = None

    def _make(self) -> Iterable[Any]:
        raise NotImplementedError

    def _all(self) -> tuple[Any, ...]:
        if self._made is None:
            self._made = tuple(self._make())
        return self._made

    def __iter__(self) -> Iterator[Any]:
        return iter(self._all())

    def __getitem__(self, i: Any) -> Any:
        return self._all()[i]

    def __add__(self, other: Any) -> tuple[Any, ...]:
        return self._all() + tuple(other)

    def __radd__(self, other: Any) -> tuple[Any, ...]:
        return tuple(other) + self._all()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, tuple | _Lazy):
            return self._all() == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._all())


class Cells(_Lazy):
    """A probe's cells: a sequence of ``Cell`` that behaves as a tuple of them (``_Lazy``), kept as
    ``CellBlock`` columns and made into ``Cell`` objects on first use. A probe of a large model measures
    thousands of cells per run: the diagnosis reads them by status straight from the columns
    (``FlowMap.with_status``), and a caller that never looks at single cells never pays for them."""

    __slots__ = ("_blocks",)

    def __init__(self, blocks: Iterable[CellBlock]) -> None:
        super().__init__()
        self._blocks = tuple(blocks)

    @property
    def blocks(self) -> tuple[CellBlock, ...]:
        return self._blocks

    def _make(self) -> Iterable[Cell]:
        return chain.from_iterable(b.cells() for b in self._blocks)

    def __len__(self) -> int:
        return sum(len(b.names) for b in self._blocks)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Cells, (self._blocks,))


class Parameters(_Lazy):
    """A probe's ``ParameterInfo`` list as columns (``_Lazy``): names, shapes, sizes, ``requires_grad``,
    one dtype and one device; made into objects on first use (the diagnosis asks only for the
    trainable names, read from the columns)."""

    __slots__ = ("device", "dtype", "names", "numels", "requires_grad", "shapes")

    def __init__(
        self,
        names: Sequence[str],
        shapes: Sequence[tuple[int, ...]],
        numels: Sequence[int],
        requires_grad: Sequence[bool],
        dtype: str,
        device: str,
    ) -> None:
        super().__init__()
        self.names, self.shapes, self.numels, self.requires_grad = names, shapes, numels, requires_grad
        self.dtype, self.device = dtype, device

    def _make(self) -> Iterable[ParameterInfo]:
        return map(
            _make_parameter_info, self.names, self.shapes, self.numels, self.requires_grad,
            repeat(self.dtype), repeat(self.device),
        )  # fmt: skip

    def __len__(self) -> int:
        return len(self.names)

    def trainable(self) -> tuple[str, ...]:
        return tuple(compress(self.names, self.requires_grad))

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            Parameters,
            (self.names, self.shapes, self.numels, self.requires_grad, self.dtype, self.device),
        )


def _by_status_of_blocks(blocks: Iterable[CellBlock]) -> dict[tuple[str, str], dict[str, list[str]]]:
    """``FlowMap._by_status`` from a probe's columns: per run, its parameters of each status, in
    order, at C speed (one ``compress`` per status present). A probe lists each parameter once per
    run (the frozen ones in a block of their own), so nothing is overwritten as in ``_index``."""
    out: dict[tuple[str, str], dict[str, list[str]]] = {}
    for b in blocks:
        groups = out.setdefault((b.variant, b.scenario), {})
        statuses = b.statuses
        present = set(statuses)
        if len(present) == 1:
            groups.setdefault(next(iter(present)), []).extend(b.names)
            continue
        for st in present:
            groups.setdefault(st, []).extend(compress(b.names, map(st.__eq__, statuses)))
    return out


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
    parameters: Sequence[ParameterInfo]  # a tuple, or a probe's ``Parameters`` (made on first use)
    cells: Sequence[Cell]  # a tuple, or a probe's ``Cells`` (made into Cell objects on first use)
    findings: tuple[Finding, ...] = ()
    gradprobe_version: str = ""
    notes: dict[str, str] = field(default_factory=dict)
    # the spec's expect=, normalised: {scenario: {"reaches": [prefix, ...], "not_reaches": [...]}}
    expect: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    reference: str = "eager"  # the variant others are compared with
    rtol: float | None = None  # relative L1 error above which a value counts as wrong
    warnings: tuple[str, ...] = ()
    bisections: tuple[dict[str, Any], ...] = ()  # bisect.Bisection.to_dict() per failing variant
    breaks: tuple[dict[str, Any], ...] = ()  # locate.Break.to_dict(): where chains break in the model
    checks: dict[str, Any] = field(default_factory=dict)  # verification results by check name (checks.py)
    # What the evidence layer gathered (gradprobe.evidence): lineage, confirmations, dynamo events.
    evidence: dict[str, Any] = field(default_factory=dict)
    schema: str = SCHEMA

    # ----- queries -------------------------------------------------------------------------------

    @_cached
    def _index(self) -> dict[tuple[str, str], dict[str, Cell]]:
        index: dict[tuple[str, str], dict[str, Cell]] = {}
        for c in self.cells:
            index.setdefault((c.variant, c.scenario), {})[c.parameter] = c
        return index

    @_cached
    def variant_names(self) -> tuple[str, ...]:
        return tuple(v.name for v in self.variants)

    @_cached
    def scenario_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.scenarios)

    @_cached
    def _runs(self) -> dict[tuple[str, str], Run]:
        index: dict[tuple[str, str], Run] = {}
        for r in self.runs:
            index.setdefault((r.variant, r.scenario), r)  # the first, as a scan would find
        return index

    @_cached
    def trainable(self) -> tuple[str, ...]:
        """Names of the parameters that can receive a gradient (``requires_grad=True``)."""
        params = self.parameters
        if isinstance(params, Parameters) and params._made is None:
            return params.trainable()
        return tuple(p.name for p in params if p.requires_grad)

    @_cached
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

    @_cached
    def _by_status(self) -> dict[tuple[str, str], dict[str, list[str]]]:
        """Per run, the parameters of each status in cell order (one pass over the cells: several
        detectors ask which parameters are non-finite or reached, for thousands of parameters)."""
        cells = self.cells
        if isinstance(cells, Cells) and cells._made is None:
            return _by_status_of_blocks(cells.blocks)
        # Each run's statuses by parameter as ``_index`` has them (a parameter listed twice keeps its
        # last cell), without a dict of cells: the cells come run by run, so a run is looked up only
        # when it changes.
        per_run: dict[tuple[str, str], dict[str, str]] = {}
        variant = scenario = None
        statuses: dict[str, str] = {}
        for c in self.cells:
            if c.variant is not variant or c.scenario is not scenario:
                variant, scenario = c.variant, c.scenario
                statuses = per_run.setdefault((variant, scenario), {})
            statuses[c.parameter] = c.status
        out: dict[tuple[str, str], dict[str, list[str]]] = {}
        for key, statuses in per_run.items():
            groups: dict[str, list[str]] = {}
            out[key] = groups
            if len(set(statuses.values())) == 1:  # the usual case: one status for the whole run
                groups[next(iter(statuses.values()))] = list(statuses)
                continue
            for p, st in statuses.items():
                groups.setdefault(st, []).append(p)
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
            # Cells are most of a map and hold no nested values: written field by field (asdict
            # walks and copies each value, several times slower for a million cells).
            "cells": [
                {
                    "variant": c.variant,
                    "scenario": c.scenario,
                    "parameter": c.parameter,
                    "status": c.status,
                    "norm": c.norm,
                    "rel_error": c.rel_error,
                    "verdict": c.verdict,
                }
                for c in self.cells
            ],
            "findings": [asdict(f) for f in self.findings],
            "notes": dict(self.notes),
            "expect": {s: {k: list(v) for k, v in e.items()} for s, e in self.expect.items()},
            "reference": self.reference,
            "rtol": self.rtol,
            "warnings": list(self.warnings),
            "bisections": list(self.bisections),
            "breaks": list(self.breaks),
            "checks": dict(self.checks),
            "evidence": dict(self.evidence),
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
        """A flow map from its ``to_dict()`` form, validated field by field.

        Anything else (another schema, a newer version, a missing field, a value of the wrong type
        anywhere, nesting deeper than ``MAX_DEPTH``) raises one ``FlowMapFormatError`` that names the
        field. Fields this version does not know are ignored (later versions only add fields).
        """
        return cls._build(d)

    @classmethod
    def _build(cls, d: Any, parsed: bool = False) -> FlowMap:
        """``from_dict``; ``parsed``: ``d`` was just parsed from JSON by ``from_json`` (depth and numbers
        already checked) and is gradprobe's own, so its cells are released as they are converted."""
        if not isinstance(d, Mapping):
            raise FlowMapFormatError(
                f"not a gradprobe flow map: a flow map is a JSON object, got {_json_type(d)}"
            )
        _check_schema(d.get("schema"))
        if not parsed:
            _check_depth(d)
        r = _Fields(d, "the flow map")
        try:
            fm = cls(
                schema=SCHEMA,
                gradprobe_version=r.text("gradprobe_version", ""),
                torch_version=r.text("torch_version"),
                device=r.text("device"),
                dtype=r.text("dtype"),
                mode=r.choice("mode", MODES),
                terms=tuple(r.texts("terms")),
                scenarios=tuple(
                    ScenarioInfo(s.text("name"), tuple(s.texts("terms"))) for s in r.objects("scenarios")
                ),
                variants=tuple(
                    VariantInfo(
                        v.text("name"),
                        v.obj("knobs", {}),
                        v.run_error("error"),
                        v.count("compile_count"),
                        v.number("seconds", 0.0),
                        v.text("capture", "eager"),
                        v.opt_text("backend"),
                        v.count("graphs"),
                        v.count("graph_breaks"),
                        _second_batch(v),
                        v.opt_obj("graph"),
                    )
                    for v in r.objects("variants")
                ),
                runs=tuple(
                    Run(
                        x.text("variant"),
                        x.text("scenario"),
                        x.numbers_by_name("term_values"),
                        x.number("total", None),
                        x.run_error("error"),
                        x.number("seconds", 0.0),
                        x.count("compiled_graphs"),
                        x.number("grad_cosine", None),
                        x.number("grad_scale", None),
                        x.numbers_by_name("metrics"),
                    )
                    for x in r.objects("runs")
                ),
                parameters=_parameters(r),
                cells=_cells(r, consume=parsed),
                findings=tuple(
                    Finding(
                        f.text("cause"),
                        f.choice("severity", SEVERITIES, what="severity"),
                        f.text("message"),
                        f.obj("evidence", {}),
                        _location(f),
                        f.text("fix", ""),
                        tuple(f.texts("references", ())),
                    )
                    for f in r.objects("findings", ())
                ),
                notes=r.texts_by_name("notes"),
                expect=_expect(r),
                reference=r.text("reference", "eager"),
                rtol=r.number("rtol", None),
                warnings=tuple(r.texts("warnings", ())),
                bisections=tuple(dict(b.data) for b in r.objects("bisections", ())),
                breaks=tuple(dict(b.data) for b in r.objects("breaks", ())),
                checks=_decode_nonfinite(r.obj("checks", {})),
                evidence=_decode_nonfinite(r.obj("evidence", {})),
            )
        except FlowMapFormatError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError, RecursionError) as e:
            # Not expected after the checks above; still one error type for whatever the file holds.
            raise FlowMapFormatError(f"malformed flow map: {type(e).__name__}: {e}") from None
        _check_consistency(fm)
        return fm

    @classmethod
    def from_json(cls, source: str | os.PathLike[str], *, max_bytes: int | None = None) -> FlowMap:
        """Read a flow map from JSON text or from a file path. Only JSON is ever parsed.

        Nothing is unpickled or imported: a saved flow map is data. A file larger than ``max_bytes``
        (default ``MAX_BYTES``, 256 MiB, or the environment variable ``GRADPROBE_FLOWMAP_MAX_BYTES``)
        is refused before it is read. Every problem raises one ``FlowMapFormatError``; for a file, its
        message starts with the file's path.
        """
        if not isinstance(source, str | os.PathLike):
            raise FlowMapFormatError(f"from_json takes JSON text or a path, got {type(source).__name__}")
        limit = _max_bytes(max_bytes)
        if isinstance(source, os.PathLike) or not _looks_like_json(source):
            path = Path(source)
            try:
                data = _parse(_read_text(path, limit))  # the text is freed before the map is built
                return cls._build(data, parsed=True)
            except FlowMapFormatError as e:
                raise FlowMapFormatError(f"{path}: {e}") from None
        if len(source) > limit:
            raise FlowMapFormatError(_too_large("the JSON text", len(source), limit))
        return cls._build(_parse(source), parsed=True)

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


# ----- reading untrusted files -------------------------------------------------------------------

MAX_BYTES = 256 * 2**20  # about a million cells (50,000 parameter tensors x 20 runs) at ~250 bytes each
MAX_BYTES_ENV = "GRADPROBE_FLOWMAP_MAX_BYTES"
MAX_DEPTH = 64  # gradprobe writes at most about 8 levels; deeper input would only strain recursion
MODES = ("terms", "weights")
_SCHEMA_NAME = SCHEMA.rsplit("/", 1)[0] + "/"
_MAX_INT = 2**63 - 1  # sizes and counts are int64 in torch
_REQUIRED: Any = object()


def _json_type(x: Any) -> str:
    """How a value reads in JSON terms, with a short excerpt: ``a number (12)``, ``a list``, ..."""
    if x is None:
        return "null"
    if isinstance(x, bool):
        return f"a boolean ({'true' if x else 'false'})"
    if isinstance(x, int | float):
        text = (
            repr(x)
            if not isinstance(x, int) or x.bit_length() < 64
            else f"an integer of {x.bit_length()} bits"
        )
        return f"a number ({text})"
    if isinstance(x, str):
        return f"a string ({x[:40]!r}{'...' if len(x) > 40 else ''})"
    if isinstance(x, Mapping):
        return "an object"
    if isinstance(x, list | tuple):
        return "a list"
    return type(x).__name__


def _malformed(where: str, expected: str, got: Any) -> FlowMapFormatError:
    return FlowMapFormatError(f"malformed flow map: {where}: expected {expected}, got {_json_type(got)}")


class _Fields:
    """Typed access to one JSON object of the flow map; every failure names the field's place."""

    def __init__(self, data: Mapping[str, Any], where: str) -> None:
        self.data, self.where = data, where

    def _at(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where != "the flow map" else key

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        if key in self.data:
            return self.data[key]
        if default is _REQUIRED:
            raise FlowMapFormatError(f"malformed flow map: KeyError: {self.where} has no field {key!r}")
        return default

    def text(self, key: str, default: Any = _REQUIRED) -> str:
        x = self.get(key, default)
        if not isinstance(x, str):
            raise _malformed(self._at(key), "a string", x)
        return x

    def opt_text(self, key: str) -> str | None:
        x = self.get(key, None)
        if x is not None and not isinstance(x, str):
            raise _malformed(self._at(key), "a string or null", x)
        return x

    def flag(self, key: str) -> bool:
        x = self.get(key)
        if not isinstance(x, bool):
            raise _malformed(self._at(key), "true or false", x)
        return x

    def choice(self, key: str, choices: tuple[str, ...], what: str = "") -> str:
        x = self.get(key)
        if not isinstance(x, str) or x not in choices:
            name = what or key
            shown = repr(x[:40]) if isinstance(x, str) else _json_type(x)
            raise FlowMapFormatError(
                f"malformed flow map: {self._at(key)}: unknown {name} {shown}; expected one of: {', '.join(choices)}"
            )
        return x

    def opt_choice(self, key: str, choices: tuple[str, ...], what: str) -> str | None:
        return None if self.get(key, None) is None else self.choice(key, choices, what)

    def number(self, key: str, default: Any = _REQUIRED) -> Any:
        return _number(self.get(key, default), self._at(key))

    def _int(self, x: Any, where: str, expected: str) -> int:
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= _MAX_INT:
            raise _malformed(where, expected, x)
        return x

    def size(self, key: str) -> int:
        return self._int(self.get(key), self._at(key), "a non-negative integer")

    def sizes(self, key: str) -> list[int]:
        return [
            self._int(n, f"{self._at(key)}[{i}]", "a non-negative integer")
            for i, n in enumerate(self.array(key))
        ]

    def count(self, key: str) -> int | None:
        x = self.get(key, None)
        return None if x is None else self._int(x, self._at(key), "a non-negative integer or null")

    def array(self, key: str, default: Any = _REQUIRED) -> list[Any]:
        x = self.get(key, default)
        if not isinstance(x, list | tuple):
            raise _malformed(self._at(key), "a list", x)
        return x if type(x) is list else list(x)

    def texts(self, key: str, default: Any = _REQUIRED) -> list[str]:
        items = self.array(key, default)
        for i, s in enumerate(items):
            if not isinstance(s, str):
                raise _malformed(f"{self._at(key)}[{i}]", "a string", s)
        return items

    def obj(self, key: str, default: Any = _REQUIRED) -> dict[str, Any]:
        x = self.get(key, default)
        if not isinstance(x, Mapping):
            raise _malformed(self._at(key), "an object", x)
        return _str_keys(x, self._at(key))

    def opt_obj(self, key: str) -> dict[str, Any] | None:
        return None if self.get(key, None) is None else self.obj(key)

    def objects(self, key: str, default: Any = _REQUIRED) -> Iterator[_Fields]:
        """Each element of a list of objects, checked as it is reached (no list of all of them)."""
        for i, x in enumerate(self.array(key, default)):
            yield _object(x, f"{self._at(key)}[{i}]")

    def texts_by_name(self, key: str) -> dict[str, str]:
        d = self.obj(key, {})
        for k, v in d.items():
            if not isinstance(v, str):
                raise _malformed(f"{self._at(key)}[{k!r}]", "a string", v)
        return d

    def numbers_by_name(self, key: str) -> dict[str, float | None]:
        return {k: _number(v, f"{self._at(key)}[{k!r}]") for k, v in self.obj(key, {}).items()}

    def run_error(self, key: str) -> RunError | None:
        x = self.get(key, None)
        if x is None:
            return None
        if not isinstance(x, Mapping):
            raise _malformed(self._at(key), "an object or null", x)
        e = _Fields(x, self._at(key))
        return RunError(e.text("stage"), e.text("type"), e.text("message"), e.opt_obj("where"),
                        tuple(e.texts("frames", [])))  # fmt: skip


def _str_keys(d: Mapping[Any, Any], where: str) -> dict[str, Any]:
    for k in d:
        if not isinstance(k, str):  # JSON keys are strings; from_dict may be handed other mappings
            raise _malformed(f"{where} key", "a string", k)
    return d if type(d) is dict else dict(d)  # read only: no copy of a plain dict


def _object(x: Any, where: str) -> _Fields:
    if not isinstance(x, Mapping):
        raise _malformed(where, "an object", x)
    return _Fields(_str_keys(x, where), where)


_STATUSES = {x: x for x in STATUSES}
_VERDICTS = {x: x for x in VERDICTS}


def _cell_maker() -> Any:
    """``Cell(...)`` at half the cost, for the million cells of a large map: the frozen dataclass's
    ``__init__`` goes through ``object.__setattr__`` per field; this sets the same slots directly."""
    fields = ("variant", "scenario", "parameter", "status", "norm", "rel_error", "verdict")
    assert tuple(Cell.__slots__) == fields  # type: ignore[attr-defined]
    sv, ss, sp, st, sn, sr, sx = (getattr(Cell, f).__set__ for f in fields)
    new = object.__new__

    def make(
        variant: str,
        scenario: str,
        parameter: str,
        status: str,
        norm: float | None,
        rel_error: float | None,
        verdict: str | None,
    ) -> Cell:
        cell = new(Cell)
        sv(cell, variant)
        ss(cell, scenario)
        sp(cell, parameter)
        st(cell, status)
        sn(cell, norm)
        sr(cell, rel_error)
        sx(cell, verdict)
        return cell

    return make


_make_cell = _cell_maker()


def _slots_maker(cls: type) -> Any:
    """``cls(*values)`` for a frozen slots dataclass without the frozen ``__init__``'s per-field
    ``object.__setattr__`` (as ``_cell_maker``): the slot setters called directly."""
    names = tuple(f.name for f in fields(cls))
    setters = tuple(getattr(cls, n).__set__ for n in names)
    new = object.__new__

    def make(*values: Any) -> Any:
        if len(values) != len(setters):
            raise TypeError(f"{cls.__name__} takes {len(setters)} values, got {len(values)}")
        obj = new(cls)
        for _ in map(operator.call, setters, repeat(obj), values):  # each setter called in C
            pass
        return obj

    return make


make_run = _slots_maker(Run)  # every field given, in order: a probe makes one per (variant, scenario)


def flow_map(**given: Any) -> FlowMap:
    """``FlowMap(**given)`` without the frozen ``__init__``'s per-field ``object.__setattr__`` (25 of
    them): the instance's ``__dict__`` filled at once, defaults (fresh for the mutable ones) for what
    is not given. Unknown or missing fields fail as ``FlowMap(...)`` would."""
    unknown = given.keys() - _FLOWMAP_FIELDS
    if unknown:
        raise TypeError(f"FlowMap got unexpected fields {sorted(unknown)}")
    missing = [n for n in _FLOWMAP_REQUIRED if n not in given]
    if missing:
        raise TypeError(f"FlowMap is missing fields {missing}")
    fm = object.__new__(FlowMap)
    d = fm.__dict__
    d.update(_FLOWMAP_DEFAULTS)
    for name, factory in _FLOWMAP_FACTORIES:
        if name not in given:
            d[name] = factory()
    d.update(given)
    return fm


_FLOWMAP_FIELDS = frozenset(f.name for f in fields(FlowMap))
_FLOWMAP_REQUIRED = tuple(
    f.name for f in fields(FlowMap) if f.default is MISSING and f.default_factory is MISSING
)
_FLOWMAP_DEFAULTS = {f.name: f.default for f in fields(FlowMap) if f.default is not MISSING}
_FLOWMAP_FACTORIES = tuple(
    (f.name, f.default_factory) for f in fields(FlowMap) if f.default_factory is not MISSING
)


def _expect(r: _Fields) -> dict[str, dict[str, list[str]]]:
    """The spec's declarations: {scenario: {"reaches": [...], "not_reaches": [...]}} (older maps: {})."""
    out = {}
    for scenario, entry in r.obj("expect", {}).items():
        e = _object(entry, f"expect[{scenario!r}]")
        out[scenario] = {k: e.texts(k, []) for k in ("reaches", "not_reaches")}
    return out


def _parameters(r: _Fields) -> tuple[ParameterInfo, ...]:
    """The parameter list: a fast check per entry, the field-by-field reading where it fails."""
    shared: dict[str, str] = {}
    keep = shared.setdefault
    out = []
    where = r._at("parameters")
    for i, x in enumerate(r.array("parameters")):
        if type(x) is dict and len(x) <= 6:
            name, shape, numel = x.get("name"), x.get("shape"), x.get("numel")
            grad, dtype, device = x.get("requires_grad"), x.get("dtype", ""), x.get("device", "")
            if (
                type(name) is str
                and type(shape) is list
                and all(type(n) is int and 0 <= n <= _MAX_INT for n in shape)
                and type(numel) is int
                and 0 <= numel <= _MAX_INT
                and type(grad) is bool
                and type(dtype) is str
                and type(device) is str
            ):
                out.append(
                    ParameterInfo(name, tuple(shape), numel, grad, keep(dtype, dtype), keep(device, device))
                )
                continue
        p = _object(x, f"{where}[{i}]")
        out.append(
            ParameterInfo(
                p.text("name"),
                tuple(p.sizes("shape")),
                p.size("numel"),
                p.flag("requires_grad"),
                p.text("dtype", ""),
                p.text("device", ""),
            )
        )
    return tuple(out)


def _cells(r: _Fields, consume: bool) -> tuple[Cell, ...]:
    """The cells, most of a flow map: a fast check of each cell's fields, and for a cell that fails it
    the field-by-field reading that names what is wrong. Strings that repeat (variant, scenario,
    parameter, status names) are kept once. ``consume``: the list is gradprobe's own (just parsed) and
    each cell's dict is released once converted, so the parsed cells and the converted ones are not
    all held at once."""
    items = r.array("cells")
    shared: dict[str, str] = {}
    keep = shared.setdefault
    make = _make_cell
    statuses, verdicts = _STATUSES, _VERDICTS  # the canonical strings, one object each
    out: list[Cell] = []
    append = out.append
    where = r._at("cells")
    for i, c in enumerate(items):
        if type(c) is dict and len(c) <= 7:
            v, s, p, st = c.get("variant"), c.get("scenario"), c.get("parameter"), c.get("status")
            norm, rel, ver = c.get("norm"), c.get("rel_error"), c.get("verdict")
            if (
                type(v) is str
                and type(s) is str
                and type(p) is str
                and type(st) is str
                and (st := statuses.get(st)) is not None
                and (ver is None or (type(ver) is str and (ver := verdicts.get(ver)) is not None))
                and (norm is None or (type(norm) is float and norm != _INF and norm != _NINF))
                and (rel is None or (type(rel) is float and rel != _INF and rel != _NINF))
            ):
                append(make(keep(v, v), keep(s, s), keep(p, p), st, norm, rel, ver))
                if consume:
                    items[i] = None
                continue
        f = _object(c, f"{where}[{i}]")
        append(
            Cell(
                f.text("variant"),
                f.text("scenario"),
                f.text("parameter"),
                f.choice("status", STATUSES, what="status"),
                f.number("norm", None),
                f.number("rel_error", None),
                f.opt_choice("verdict", VERDICTS, what="verdict"),
            )
        )
        if consume:
            items[i] = None
    return tuple(out)


def _number(x: Any, where: str) -> float | None:
    """A JSON number, null, or one of the strings "nan", "inf", "-inf", as a Python float."""
    if x is None:
        return None
    if isinstance(x, str):
        if x not in _NONFINITE:
            raise FlowMapFormatError(
                f"malformed flow map: {where}: expected a number, got the string {x[:40]!r} "
                '(non-finite numbers are written "nan", "inf", "-inf")'
            )
        return _NONFINITE[x]
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise _malformed(where, "a number", x)
    try:
        value = float(x)
    except OverflowError:
        raise _malformed(where, "a number within the float range", x) from None
    if math.isinf(value):  # a literal such as 1e999: JSON has no infinity, gradprobe writes "inf"
        raise _malformed(where, "a number within the float range", x)
    return value


def _decode_nonfinite(x: Any) -> Any:
    """Measurement data (checks, second batch) with the strings "nan", "inf", "-inf" back as floats, as
    they were before ``to_json`` encoded them: renderers format these numbers (depth is bounded).
    Containers holding none of them are returned as they are, not copied."""
    if isinstance(x, str):
        return _NONFINITE.get(x, x)
    if isinstance(x, Mapping):
        decoded = {k: _decode_nonfinite(v) for k, v in x.items()}
        return x if type(x) is dict and all(decoded[k] is v for k, v in x.items()) else decoded
    if isinstance(x, list | tuple):
        items = [_decode_nonfinite(v) for v in x]
        return x if type(x) is list and all(a is b for a, b in zip(items, x, strict=True)) else items
    return x


def _second_batch(v: _Fields) -> dict[str, Any] | None:
    """``second_batch`` as documented: scenario, mismatched parameters, stale term values, error, max error."""
    if v.get("second_batch", None) is None:
        return None
    sb = _Fields(v.obj("second_batch"), v._at("second_batch"))
    sb.text("scenario")
    sb.texts("mismatched")
    sb.opt_text("error")
    sb.number("max_rel_error", None)
    for t, values in sb.obj("term_values", {}).items():
        pair = _Fields(values, f"{sb.where}.term_values[{t!r}]") if isinstance(values, Mapping) else None
        if pair is None:
            raise _malformed(f"{sb.where}.term_values[{t!r}]", "an object", values)
        pair.number("variant", None)
        pair.number("reference", None)
    return _decode_nonfinite(sb.data)


def _location(f: _Fields) -> dict[str, Any] | None:
    """A finding's location: where in the model (file, line, module, code) or which modules."""
    if f.get("location", None) is None:
        return None
    loc = _Fields(f.obj("location"), f._at("location"))
    for key in ("file", "module", "module_type", "code"):
        loc.opt_text(key)
    if loc.get("line", None) is not None:
        loc.size("line")
    if "modules" in loc.data:
        loc.texts("modules")
    return loc.data


def _check_schema(schema: Any) -> None:
    if schema == SCHEMA:
        return
    if isinstance(schema, str) and schema.startswith(_SCHEMA_NAME):
        version = schema.removeprefix(_SCHEMA_NAME)
        ours = int(SCHEMA.removeprefix(_SCHEMA_NAME))
        if version.isdigit() and len(version) < 10 and int(version) > ours:
            raise FlowMapFormatError(
                f"flow map schema {schema!r} is not supported by this gradprobe (reads {SCHEMA!r}): "
                "it was written by a newer gradprobe; upgrade gradprobe to read it (pip install -U gradprobe)"
            )
    shown = repr(schema[:60]) if isinstance(schema, str) else _json_type(schema)
    raise FlowMapFormatError(f"not a gradprobe flow map: schema is {shown}, expected {SCHEMA!r}")


def _check_depth(data: Any) -> None:
    """Refuse nesting deeper than MAX_DEPTH, and numbers past the float range (JSON has no infinity: an
    inf here is a literal such as 1e999 that overflowed). Walked without recursion, holding one
    iterator per level (never a list of every value)."""
    stack = [iter((data,))]
    while stack:
        for x in stack[-1]:
            t = type(x)
            if t is dict:
                children: Any = x.values()
            elif t is list:
                children = x
            elif t is str or t is int or t is bool or x is None:
                continue
            elif t is float:
                if x == _INF or x == -_INF:
                    raise FlowMapFormatError(_OUT_OF_RANGE)
                continue
            elif isinstance(x, Mapping):
                children = x.values()
            elif isinstance(x, list | tuple):
                children = x
            else:
                continue
            if not children:
                continue
            if len(stack) >= MAX_DEPTH:
                raise FlowMapFormatError(
                    f"malformed flow map: nested more than {MAX_DEPTH} levels deep (gradprobe writes fewer than 10)"
                )
            stack.append(iter(children))
            break
        else:
            stack.pop()


_INF, _NINF = math.inf, -math.inf
_OUT_OF_RANGE = "malformed flow map: a number beyond the float range"


class _LiteralFoundError(Exception):
    pass


def _out_of_range_literal(text: str) -> str:
    """The first number literal in ``text`` that reads as inf: a second parse, only once one was found."""

    def check(literal: str) -> float:
        if math.isinf(value := float(literal)):
            raise _LiteralFoundError(literal)
        return value

    try:
        json.loads(text, parse_float=check, parse_constant=_reject_constant)
    except _LiteralFoundError as found:
        literal = str(found)
        return literal if len(literal) <= 40 else literal[:37] + "..."
    except Exception:
        pass
    return "?"


# What parsing may take, per JSON value, at most: a list (header and spare room), a dict (header and
# its first entries), a dict entry, a list slot with a float, a string that is not a key (json keeps
# each key once). A flow map gradprobe writes comes to 4-7x its size by this count; 20 MB of "[],"
# would take 1.2 GB (41x). Above MAX_PARSE_FACTOR the text is refused before it is parsed.
MAX_PARSE_FACTOR = 9
_DENSITY_FROM = 64 * 1024  # below this, whatever the parse takes is small


def _check_density(text: str) -> None:
    n = len(text)
    if n < _DENSITY_FROM:
        return
    keys = text.count('":')
    strings = text.count('"') // 2 - keys
    estimate = (
        72 * text.count("[")
        + 160 * text.count("{")
        + 16 * text.count(":")
        + 32 * text.count(",")
        + 60 * max(strings, 0)
        + 8 * keys
    )
    if estimate > MAX_PARSE_FACTOR * n:
        raise FlowMapFormatError(
            f"malformed flow map: too many values for its size ({n:,} bytes holding values that would take "
            f"about {estimate / n:.0f}x that to read; gradprobe writes maps that take under "
            f"{MAX_PARSE_FACTOR}x): not read"
        )


def _check_consistency(fm: FlowMap) -> None:
    """What every reader of a flow map relies on and gradprobe always writes: unique names, scenarios of
    declared terms, exactly one run per (variant, scenario), and a reference among the variants."""

    def unique(kind: str, names: Iterable[str]) -> list[str]:
        seen: list[str] = []
        for n in names:
            if n in seen:
                raise FlowMapFormatError(f"malformed flow map: {kind} {n[:60]!r} appears twice")
            seen.append(n)
        return seen

    unique("term", fm.terms)
    variants = set(unique("variant", fm.variant_names))
    scenarios = set(unique("scenario", fm.scenario_names))
    for s in fm.scenarios:
        unknown = [t for t in s.terms if t not in fm.terms]
        if unknown:
            raise FlowMapFormatError(
                f"malformed flow map: scenario {s.name[:60]!r} switches on {unknown[0][:60]!r}, which is not a term"
            )
    if fm.scenarios and fm.reference not in variants:
        raise FlowMapFormatError(
            f"malformed flow map: the reference variant {fm.reference[:60]!r} is not among the variants"
        )
    pairs: set[tuple[str, str]] = set()
    for r in fm.runs:
        if r.variant not in variants or r.scenario not in scenarios:
            raise FlowMapFormatError(
                f"malformed flow map: a run of variant {r.variant[:60]!r}, scenario {r.scenario[:60]!r}, "
                "which the flow map does not declare"
            )
        if (r.variant, r.scenario) in pairs:
            raise FlowMapFormatError(
                f"malformed flow map: two runs of variant {r.variant[:60]!r}, scenario {r.scenario[:60]!r}"
            )
        pairs.add((r.variant, r.scenario))
    if len(pairs) != len(variants) * len(scenarios):
        v, s = next((v, s) for v in fm.variant_names for s in fm.scenario_names if (v, s) not in pairs)
        raise FlowMapFormatError(f"malformed flow map: no run of variant {v[:60]!r}, scenario {s[:60]!r}")


def _max_bytes(given: int | None) -> int:
    if given is not None:
        if isinstance(given, bool) or not isinstance(given, int) or given <= 0:
            raise FlowMapFormatError(f"max_bytes must be a positive integer, got {given!r}")
        return given
    env = os.environ.get(MAX_BYTES_ENV)
    if env is None or not env.strip():
        return MAX_BYTES
    try:
        value = int(env)
    except ValueError:
        value = 0
    if value <= 0:
        raise FlowMapFormatError(f"{MAX_BYTES_ENV} must be a positive number of bytes, got {env[:40]!r}")
    return value


def _too_large(what: str, size: int, limit: int) -> str:
    return (
        f"{what} is {size:,} bytes, over the limit of {limit:,} bytes ({limit / 2**20:.0f} MiB) for a flow "
        f"map: not read. If you trust it, raise the limit: FlowMap.from_json(..., max_bytes=N) or the "
        f"environment variable {MAX_BYTES_ENV}=N"
    )


def _looks_like_json(source: Any) -> bool:
    return isinstance(source, str) and source.lstrip()[:1] in ("{", "[")


_BINARY = {
    b"PK\x03\x04": "a zip archive (torch.save writes these)",
    b"\x80": "a Python pickle",
    b"\x93NUMPY": "a NumPy array",
    b"\x89HDF": "an HDF5 file",
}


def _read_text(path: Path, limit: int) -> str:
    """The file's text, refused before reading when over ``limit`` bytes; never anything but text.
    Memory: the file's bytes once, then its text (the bytes are freed on return)."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise FlowMapFormatError(_too_large("the file", size, limit))
            # A pipe or a device reports no size: read in pieces, no further than allowed (one read
            # of limit + 1 bytes would reserve all of it at once).
            data = f.read(size + 1) if size else _read_pieces(f, limit + 1)
    except OSError as e:
        raise FlowMapFormatError(f"cannot read flow map: {e.strerror or e}") from None
    except ValueError as e:  # e.g. a NUL character in the path
        raise FlowMapFormatError(f"cannot read flow map: {e}") from None
    if len(data) > limit:
        raise FlowMapFormatError(_too_large("the file", len(data), limit))
    for magic, kind in _BINARY.items():
        if data.startswith(magic):
            raise FlowMapFormatError(
                f"not a gradprobe flow map: this is {kind}, not JSON. gradprobe reads flow maps as JSON only "
                "and never unpickles or loads files (write one with --json or FlowMap.to_json)"
            )
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise FlowMapFormatError(
            f"not a gradprobe flow map: not UTF-8 text (byte {e.start}), so not JSON; flow maps are JSON "
            "files written with --json or FlowMap.to_json"
        ) from None


def _read_pieces(f: Any, most: int) -> bytes:
    pieces, total = [], 0
    while total < most:
        piece = f.read(min(2**20, most - total))
        if not piece:
            break
        pieces.append(piece)
        total += len(piece)
    return b"".join(pieces)


def _reject_constant(name: str) -> Any:
    raise FlowMapFormatError(
        f"flow map is not valid JSON: {name} is not a JSON value (flow maps write non-finite numbers as "
        'the strings "nan", "inf", "-inf")'
    )


def _parse(text: str) -> Any:
    """JSON text to plain data, its depth and numbers checked; refused first when its values would
    take more than MAX_PARSE_FACTOR times its size to hold."""
    if not text.strip():
        raise FlowMapFormatError("flow map is not valid JSON: it is empty (truncated or never written?)")
    _check_density(text)
    data = _loads(text)
    try:
        # The cells, most of the map, are checked field by field as they are read (_cells), and
        # what else they hold is dropped: the walk covers everything else.
        _check_depth({k: v for k, v in data.items() if k != "cells"} if type(data) is dict else data)
    except FlowMapFormatError as e:
        if str(e) != _OUT_OF_RANGE:
            raise
        del data  # not held while the text is parsed again to find the literal
    else:
        return data
    raise FlowMapFormatError(f"{_OUT_OF_RANGE} ({_out_of_range_literal(text)})")


def _loads(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        end = len(text.rstrip())
        if e.pos >= end or e.msg.startswith("Unterminated string"):
            raise FlowMapFormatError(
                f"flow map is not valid JSON: truncated, it ends before the JSON is complete ({e})"
            ) from None
        raise FlowMapFormatError(f"flow map is not valid JSON: {e}") from None
    except RecursionError:
        raise FlowMapFormatError(
            f"malformed flow map: nested too deeply to parse (more than {MAX_DEPTH} levels is refused)"
        ) from None
    except ValueError as e:  # an integer of more than 4300 digits
        raise FlowMapFormatError(f"malformed flow map: a number too large to read ({e})") from None


def parameter_infos(named: Iterable[tuple[str, Any]]) -> Sequence[ParameterInfo]:
    """ParameterInfo for each (name, parameter) pair: ``Parameters`` columns where they share one dtype
    and one device, else a tuple."""
    named = list(named)
    params = [p for _, p in named]
    dtypes, devices = set(map(_DTYPE, params)), set(map(_DEVICE, params))
    if len(dtypes) == 1 and len(devices) == 1:  # the usual case: columns, objects made on first use
        return Parameters(  # type: ignore[return-value]
            [n for n, _ in named],
            list(map(tuple, map(_SHAPE, params))),
            list(map(_NUMEL, params)),
            list(map(_REQUIRES_GRAD, params)),
            str(dtypes.pop()).removeprefix("torch."),
            str(devices.pop()),
        )
    names: dict[Any, str] = {}  # dtype and device names, spelled once each (thousands of parameters)
    out = []
    for n, p in named:
        dtype, device = p.dtype, p.device
        dtype_name = names.get(dtype)
        if dtype_name is None:
            dtype_name = names[dtype] = str(dtype).removeprefix("torch.")
        device_name = names.get(device)
        if device_name is None:
            device_name = names[device] = str(device)
        out.append(
            _make_parameter_info(n, tuple(p.shape), p.numel(), p.requires_grad, dtype_name, device_name)
        )
    return tuple(out)


def _parameter_info_maker() -> Any:
    """``ParameterInfo(...)`` without the frozen dataclass's ``object.__setattr__`` per field (one per
    parameter tensor of the model, thousands of them), as ``_cell_maker`` does for cells."""
    fields = ("name", "shape", "numel", "requires_grad", "dtype", "device")
    assert tuple(ParameterInfo.__slots__) == fields  # type: ignore[attr-defined]
    sn, ss, sc, sr, sd, sv = (getattr(ParameterInfo, f).__set__ for f in fields)
    new = object.__new__

    def make(
        name: str, shape: tuple[int, ...], numel: int, requires_grad: bool, dtype: str, device: str
    ) -> ParameterInfo:
        info = new(ParameterInfo)
        sn(info, name)
        ss(info, shape)
        sc(info, numel)
        sr(info, requires_grad)
        sd(info, dtype)
        sv(info, device)
        return info

    return make


_make_parameter_info = _parameter_info_maker()
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
_SHAPE = operator.attrgetter("shape")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_NUMEL = operator.methodcaller("numel")
