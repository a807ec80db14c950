"""The flow map: status and norm of every (variant, scenario, parameter), as plain, versioned data.

Every later stage (checks, locate, bisect, diagnose, reports) reads it; it holds no tensors and no model.
``to_json`` saves it, ``from_json`` reads it back equal (docs/flowmap-schema.md). The records are frozen
msgspec Structs: made ten times faster than frozen dataclasses (a probe makes thousands of cells), and
the types a saved map, untrusted input, is decoded into."""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Callable, Mapping
from functools import cached_property, partial
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import msgspec.inspect as mi

from .errors import FlowMapFormatError, did_you_mean
from .status import NONZERO

SCHEMA = "gradprobe.flowmap/1"
MAX_BYTES = 256 * 2**20  # about a million cells (50,000 parameter tensors x 20 runs) at ~250 bytes each
MAX_BYTES_ENV = "GRADPROBE_FLOWMAP_MAX_BYTES"
MAX_DEPTH = 64  # gradprobe writes at most about 8 levels; deeper input would only strain recursion

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
    # The user's frame the failure came from: {file, line, code, function}, plus ``object_type`` for a
    # method (the innermost frame outside torch and gradprobe, or the one dynamo names), None if unknown.
    where: dict[str, Any] | None = None
    # The innermost traceback frames, torch's included ("runtime_wrappers.py:2489 in coerce_to_...");
    # innermost last: what a failure signature is read from.
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
    """The gradient of one parameter in one run. ``norm`` is the L1 norm (None when status is none);
    ``rel_error`` and ``verdict`` compare it with the reference variant's cell (None in the reference)."""

    variant: str
    scenario: str
    parameter: str
    status: Literal["none", "zero", "nonzero", "nan", "inf"]  # status.STATUSES
    norm: float | None
    rel_error: float | None = None
    verdict: Literal["match", "missing", "extra", "wrong"] | None = None  # compare.VERDICTS


class Claim(msgspec.Struct, frozen=True):
    """One clause of a finding: a predicate of ``claims.PREDICATES`` and its arguments, which the map's
    own evidence must satisfy, and the sentence it renders to."""

    kind: str
    text: str
    args: dict[str, Any] = {}


class Finding(msgspec.Struct, frozen=True):
    """One diagnosed problem: a cause from the catalogue, its evidence, where it is, and the fix. The
    ``claims`` are the facts it rests on, each checkable on the map (``claims.audit``)."""

    cause: str
    severity: Literal["error", "warning", "info"]
    message: str
    evidence: dict[str, Any] = {}
    location: dict[str, Any] | None = None
    fix: str = ""
    references: tuple[str, ...] = ()
    claims: tuple[Claim, ...] = ()


class FlowMap(msgspec.Struct, frozen=True, dict=True, eq=False):
    """Result of a probe. Equality compares the serialised form (so NaN norms compare equal). Queries
    are computed once and kept (``cached_property``, in the ``__dict__`` that ``dict=True`` gives)."""

    torch_version: str
    device: str
    dtype: str
    mode: Literal["terms", "weights"]
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
    # What makes the exit status 1: an error finding (the default), or a warning too (a CI job that
    # wants every intended stop-gradient declared in notes).
    fail_on: Literal["error", "warning"] = "error"
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
        if (found := self._runs.get((variant, scenario))) is None:
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

    def mismatch(self, variant: str, scenario: str) -> dict[str, Any] | None:
        """Counts, lost/extra parameters and wrong values of one run against the reference; None if equal
        (what the flow-mismatch finding and the report's interpretation lines say of a differing run)."""
        diffs = self.differences(variant, scenario)
        if not diffs:
            return None
        wrong = {p: c.rel_error for p, c in diffs.items() if c.verdict == "wrong"}
        finite = [e for e in wrong.values() if e is not None and e == e]
        return {
            "scenario": scenario,
            "count": self.count(variant, scenario)[0],
            "reference_count": self.count(self.reference, scenario)[0],
            "missing": [p for p, c in diffs.items() if c.verdict == "missing"],
            # exact zeros apart from no gradient at all: a path that exists but carries nothing
            "missing_zero": [p for p, c in diffs.items() if c.verdict == "missing" and c.status == "zero"],
            "extra": [p for p, c in diffs.items() if c.verdict == "extra"],
            "wrong": list(wrong),
            "max_rel_error": max(finite) if finite else None,
        }

    def bisection(self, variant: str) -> dict[str, Any] | None:
        return next((b for b in self.bisections if b.get("variant") == variant), None)

    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def exit_code(self) -> int:
        """1 when a finding has severity error (or warning, with ``fail_on="warning"``), else 0 (the
        CLI's exit status)."""
        failing = ("error", "warning") if self.fail_on == "warning" else ("error",)
        return 1 if any(f.severity in failing for f in self.findings) else 0

    def to_dict(self) -> dict[str, Any]:
        """The map as JSON values; non-finite numbers as "nan", "inf", "-inf" (strict JSON has none)."""
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
        """A flow map from its ``to_dict()`` form, checked as ``from_json`` checks it. Fields this version
        does not know are ignored (later versions only add fields)."""
        return _from_data(d)

    @classmethod
    def from_json(cls, source: str | os.PathLike[str], *, max_bytes: int | None = None) -> FlowMap:
        """Read a flow map from JSON text or from a file path: only JSON is ever parsed. A file larger than
        ``max_bytes`` (default ``MAX_BYTES``, 256 MiB, or ``$GRADPROBE_FLOWMAP_MAX_BYTES``) is refused
        unread. Another schema, a newer version, a missing field, a value of the wrong type anywhere,
        nesting deeper than ``MAX_DEPTH``: one ``FlowMapFormatError`` naming the place (and the file)."""
        if not isinstance(source, str | os.PathLike):
            raise FlowMapFormatError(f"from_json takes JSON text or a path, got {type(source).__name__}")
        limit = _max_bytes(max_bytes)
        if isinstance(source, str) and source.lstrip()[:1] in ("{", "["):
            if len(source) > limit:
                raise FlowMapFormatError(_too_large("the JSON text", len(source), limit))
            return _from_data(_parse(source))
        try:  # the file's text is freed before the map is built
            return _from_data(_parse(_read_text(Path(source), limit)))
        except FlowMapFormatError as e:
            raise FlowMapFormatError(f"{Path(source)}: {e}") from None

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


# ----- reading saved maps, which are untrusted input ----------------------------------------------
# First what a typed decoder does not do: the size limit before reading, binary files refused unread,
# a density check before parsing, nesting and numbers, the schema and its version. msgspec then decodes
# the data into FlowMap strictly (a string is never a number); last, what the fields must agree on.

_SCHEMA_NAME, _VERSION = SCHEMA.rsplit("/", 1)


def _malformed(what: str) -> FlowMapFormatError:
    return FlowMapFormatError(f"malformed flow map: {what}")


_JSON_TYPES = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string",
               dict: "an object", list: "a list"}  # fmt: skip


def _from_data(d: Any) -> FlowMap:
    if not isinstance(d, Mapping):
        got = _JSON_TYPES.get(type(d), type(d).__name__)
        raise FlowMapFormatError(f"not a gradprobe flow map: a flow map is a JSON object, got {got}")
    _check_schema(d.get("schema"))
    # Cells, most of a map, are records all through: nothing free-form to nest in.
    _check_depth({k: v for k, v in d.items() if k != "cells"})
    try:
        fm = _convert(_floats_back(dict(d)), FlowMap)
        for i, v in enumerate(fm.variants):
            _convert(v.second_batch, _SecondBatch | None, f"variants[{i}].second_batch")
        for i, f in enumerate(fm.findings):
            _convert(f.location, _Location | None, f"findings[{i}].location")
    except (TypeError, ValueError, RecursionError) as e:  # not expected: still the one error type
        raise _malformed(f"{type(e).__name__}: {e}") from None
    _check_consistency(fm)
    return fm


# The documented shape of two free-form parts that renderers read by key (checked; they stay dicts).
class _SecondBatch(msgspec.Struct):  # VariantInfo.second_batch
    scenario: str
    mismatched: list[str]
    error: str | None = None
    max_rel_error: float | None = None
    term_values: dict[str, dict[str, float | None]] = {}  # {term: {"variant": x, "reference": y}}


class _Location(msgspec.Struct):  # Finding.location: where in the model, or which modules
    file: str | None = None
    line: Count | None = None
    module: str | None = None
    module_type: str | None = None
    code: str | None = None
    modules: list[str] = []


def _convert(data: Any, shape: Any, where: str = "") -> Any:
    """msgspec's "Expected `str`, got `int` - at `$.cells[0].parameter`" said as ours:
    "malformed flow map: cells[0].parameter: expected `str`, got `int`"."""
    try:
        return msgspec.convert(data, shape, strict=True)
    except msgspec.ValidationError as e:
        text, _, at = str(e).partition(" - at ")
    # "$" stands for what was converted: the whole map, or the part at ``where``.
    at = at.replace("`", "").replace("$", where or "$").replace("$.", "").replace("$", "")
    at = at or where or "the flow map"
    if text.startswith("Object missing required field"):
        raise _malformed(f"{at} has no field {text.split('`')[1]!r}") from None
    if "float" in text and text.endswith("got `str`"):
        text += ' (non-finite numbers are written "nan", "inf", "-inf")'
    raise _malformed(f"{at}: {text[:1].lower()}{text[1:]}") from None


_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _float_back(x: Any) -> Any:
    return _NONFINITE.get(x, x) if type(x) is str else x


def _decode_nonfinite(x: Any) -> Any:
    return _NONFINITE.get(x, x) if type(x) is str else _in(x, _decode_nonfinite)


def _in(x: Any, read: Callable[[Any], Any] | dict[str, Callable[[Any], Any]]) -> Any:
    """``x`` with ``read`` applied to each value in it (a dict or list), or, ``read`` being the readers
    of some fields by name, to those; ``x`` itself when that changed none (cells are not copied)."""
    out = x
    for k, v in x.items() if type(x) is dict else enumerate(x) if type(x) is list else ():
        each = read.get(k) if isinstance(read, dict) else read
        if each is not None and (new := each(v)) is not v:
            out = (dict(x) if type(x) is dict else list(x)) if out is x else out
            out[k] = new
    return out  # not a container: msgspec names what it is


def _reader(t: mi.Type) -> Callable[[Any], Any] | None:
    """What puts the floats back in a value of type ``t``, in its float places and free-form data (a
    string elsewhere stays a string); None where it has neither."""
    if isinstance(t, mi.FloatType):
        return _float_back
    if isinstance(t, mi.AnyType):
        return _decode_nonfinite
    if isinstance(t, mi.UnionType):  # ours are "X | None"
        return next(filter(None, map(_reader, t.types)), None)
    if isinstance(t, mi.DictType | mi.VarTupleType | mi.ListType):
        each = _reader(t.value_type if isinstance(t, mi.DictType) else t.item_type)
        return None if each is None else partial(_in, read=each)
    if isinstance(t, mi.StructType):
        fields = {f.encode_name: r for f in t.fields if (r := _reader(f.type)) is not None}
        return partial(_in, read=fields) if fields else None
    return None


_floats_back = _reader(mi.type_info(FlowMap)) or _decode_nonfinite


def _check_schema(schema: Any) -> None:
    if schema == SCHEMA:
        return
    name, _, version = schema.rpartition("/") if isinstance(schema, str) else ("", "", "")
    if name == _SCHEMA_NAME and version.isdigit() and len(version) < 10 and int(version) > int(_VERSION):
        raise FlowMapFormatError(
            f"flow map schema {schema!r} is not supported by this gradprobe (reads {SCHEMA!r}): "
            "it was written by a newer gradprobe; upgrade gradprobe to read it (pip install -U gradprobe)"
        )
    shown = (
        repr(schema[:60]) if isinstance(schema, str) else _JSON_TYPES.get(type(schema), type(schema).__name__)
    )
    raise FlowMapFormatError(f"not a gradprobe flow map: schema is {shown}, expected {SCHEMA!r}")


def _check_depth(data: Any) -> None:
    """Refuse nesting deeper than MAX_DEPTH (msgspec keeps free-form data as it is), without recursion."""
    stack = [iter((data,))]
    while stack:
        for x in stack[-1]:
            children = x.values() if isinstance(x, Mapping) else x if isinstance(x, list | tuple) else ()
            if children:
                if len(stack) >= MAX_DEPTH:  # gradprobe writes fewer than 10
                    raise _malformed(f"nested more than {MAX_DEPTH} levels deep")
                stack.append(iter(children))
                break
        else:
            stack.pop()


# What parsing may take, per JSON value, at most: a list (header and spare room), a dict (header and its
# first entries), a dict entry, a list slot with a float, a string not a key (json keeps each key once).
# A map gradprobe writes comes to 4-7x its size by this count; 20 MB of "[]," would take 1.2 GB (41x).
MAX_PARSE_FACTOR = 9  # above it, the text is refused before it is parsed
_DENSITY_FROM = 64 * 1024  # below this, whatever the parse takes is small


def _check_density(text: str) -> None:
    n = len(text)
    if n < _DENSITY_FROM:
        return
    keys = text.count('":')
    strings = max(text.count('"') // 2 - keys, 0)
    estimate = 72 * text.count("[") + 160 * text.count("{") + 16 * text.count(":") + 32 * text.count(",")
    estimate += 60 * strings + 8 * keys
    if estimate > MAX_PARSE_FACTOR * n:
        raise _malformed(
            f"too many values for its size ({n:,} bytes holding values that would take "
            f"about {estimate / n:.0f}x that to read; gradprobe writes maps that take under "
            f"{MAX_PARSE_FACTOR}x): not read"
        )


def _parse(text: str) -> Any:
    if not text.strip():
        raise FlowMapFormatError("flow map is not valid JSON: it is empty (truncated or never written?)")
    _check_density(text)
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite)
    except json.JSONDecodeError as e:
        if e.pos >= len(text.rstrip()) or e.msg.startswith("Unterminated string"):
            raise FlowMapFormatError(
                f"flow map is not valid JSON: truncated, it ends before the JSON is complete ({e})"
            ) from None
        raise FlowMapFormatError(f"flow map is not valid JSON: {e}") from None
    except RecursionError:
        raise _malformed(f"nested too deeply to parse (more than {MAX_DEPTH} levels is refused)") from None
    except ValueError as e:  # an integer of more than 4300 digits
        raise _malformed(f"a number too large to read ({e})") from None


def _finite(literal: str) -> float:
    """A JSON number as a float; one such as 1e999 would be an infinity, which JSON has not."""
    if math.isinf(value := float(literal)):
        raise _malformed(f"a number beyond the float range ({literal[:40]})")
    return value


def _reject_constant(name: str) -> Any:
    raise FlowMapFormatError(
        f"flow map is not valid JSON: {name} is not a JSON value (flow maps write non-finite numbers as "
        'the strings "nan", "inf", "-inf")'
    )


def _check_consistency(fm: FlowMap) -> None:
    """What readers rely on and gradprobe writes: unique names, scenarios of declared terms, a known
    reference, one run per (variant, scenario) and no other."""
    for kind, names in (("term", fm.terms), ("variant", fm.variant_names), ("scenario", fm.scenario_names)):
        if twice := next((n for n, k in Counter(names).items() if k > 1), None):
            raise _malformed(f"{kind} {twice[:60]!r} appears twice")
    terms, variants, scenarios = set(fm.terms), set(fm.variant_names), set(fm.scenario_names)
    for s in fm.scenarios:
        if unknown := [t for t in s.terms if t not in terms]:
            raise _malformed(f"scenario {s.name[:60]!r} switches on {unknown[0][:60]!r}, which is not a term")
    if fm.scenarios and fm.reference not in variants:
        raise _malformed(f"the reference variant {fm.reference[:60]!r} is not among the variants")
    runs = Counter((r.variant, r.scenario) for r in fm.runs)
    for (v, s), k in runs.items():
        at = f"variant {v[:60]!r}, scenario {s[:60]!r}"
        if v not in variants or s not in scenarios:
            raise _malformed(f"a run of {at}, which the flow map does not declare")
        if k > 1:
            raise _malformed(f"two runs of {at}")
    if len(runs) != len(variants) * len(scenarios):
        v, s = next((v, s) for v in fm.variant_names for s in fm.scenario_names if (v, s) not in runs)
        raise _malformed(f"no run of variant {v[:60]!r}, scenario {s[:60]!r}")


def _max_bytes(given: int | None) -> int:
    if given is None:
        env = os.environ.get(MAX_BYTES_ENV, "").strip()
        if env and (not env.isdecimal() or int(env) <= 0):
            raise FlowMapFormatError(f"{MAX_BYTES_ENV} must be a positive number of bytes, got {env[:40]!r}")
        return int(env) if env else MAX_BYTES
    if isinstance(given, bool) or not isinstance(given, int) or given <= 0:
        raise FlowMapFormatError(f"max_bytes must be a positive integer, got {given!r}")
    return given


def _too_large(what: str, size: int, limit: int) -> str:
    return (
        f"{what} is {size:,} bytes, over the limit of {limit:,} bytes ({limit / 2**20:.0f} MiB) for a flow "
        f"map: not read. If you trust it, raise the limit: FlowMap.from_json(..., max_bytes=N) or the "
        f"environment variable {MAX_BYTES_ENV}=N"
    )


_BINARY = {b"PK\x03\x04": "a zip archive (torch.save writes these)", b"\x80": "a Python pickle",
           b"\x93NUMPY": "a NumPy array", b"\x89HDF": "an HDF5 file"}  # fmt: skip


def _read_text(path: Path, limit: int) -> str:
    """The file's text (its bytes are freed on return), refused unread when over ``limit`` bytes."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise FlowMapFormatError(_too_large("the file", size, limit))
            # A pipe or a device reports no size: read in pieces, no further than allowed (one read
            # of limit + 1 bytes would reserve all of it at once).
            data = f.read(size + 1) if size else _read_pieces(f, limit + 1)
    except (OSError, ValueError) as e:  # ValueError: e.g. a NUL character in the path
        raise FlowMapFormatError(f"cannot read flow map: {getattr(e, 'strerror', None) or e}") from None
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
    while total < most and (piece := f.read(min(2**20, most - total))):
        pieces.append(piece)
        total += len(piece)
    return b"".join(pieces)
