"""Reading saved flow maps, which are untrusted input: JSON only, checked, then decoded by msgspec.

First what a typed decoder does not do: the size limit before reading, binary files (pickles, torch.save
archives) refused unread, a density check before parsing, nesting and numbers, the schema and its
version. msgspec then decodes the data into ``FlowMap`` strictly (a string is never a number); last,
what the fields must agree on. Every problem raises one ``FlowMapFormatError`` naming the place.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi

from .errors import FlowMapFormatError
from .flowmap import MAX_BYTES, MAX_BYTES_ENV, MAX_DEPTH, SCHEMA, Count, FlowMap

_SCHEMA_NAME = SCHEMA.rsplit("/", 1)[0] + "/"
_OUT_OF_RANGE = "malformed flow map: a number beyond the float range"


def from_json(source: str | os.PathLike[str], max_bytes: int | None) -> FlowMap:
    if not isinstance(source, str | os.PathLike):
        raise FlowMapFormatError(f"from_json takes JSON text or a path, got {type(source).__name__}")
    limit = _max_bytes(max_bytes)
    if isinstance(source, os.PathLike) or source.lstrip()[:1] not in ("{", "["):
        path = Path(source)
        try:
            data = _parse(_read_text(path, limit))  # the text is freed before the map is built
            return from_data(data, parsed=True)
        except FlowMapFormatError as e:
            raise FlowMapFormatError(f"{path}: {e}") from None
    if len(source) > limit:
        raise FlowMapFormatError(_too_large("the JSON text", len(source), limit))
    return from_data(_parse(source), parsed=True)


def from_data(d: Any, parsed: bool = False) -> FlowMap:
    """``parsed``: ``d`` comes from ``_parse``, which refused numbers beyond the float range."""
    if not isinstance(d, Mapping):
        raise FlowMapFormatError(
            f"not a gradprobe flow map: a flow map is a JSON object, got {_json_type(d)}"
        )
    _check_schema(d.get("schema"))
    # Cells are records all through, with nothing free-form to nest in (and most of a map).
    _check_depth({k: v for k, v in d.items() if k != "cells"} if parsed else d)
    try:
        fm = _convert(_floats_back(dict(d)), FlowMap)
        parts = [
            (v.second_batch, _SecondBatch, f"variants[{i}].second_batch") for i, v in enumerate(fm.variants)
        ]
        parts += [(f.location, _Location, f"findings[{i}].location") for i, f in enumerate(fm.findings)]
        for data, shape, where in parts:
            if data is not None:
                _convert(data, shape, where)
    except (TypeError, ValueError, RecursionError) as e:  # not expected: still the one error type
        raise FlowMapFormatError(f"malformed flow map: {type(e).__name__}: {e}") from None
    _check_consistency(fm)
    return fm


class _SecondBatch(msgspec.Struct):
    """``VariantInfo.second_batch`` (checked; kept as a dict): scenario, mismatched parameters, stale
    term values, error, max error."""

    scenario: str
    mismatched: list[str]
    error: str | None = None
    max_rel_error: float | None = None
    term_values: dict[str, dict[str, float | None]] = {}  # {term: {"variant": x, "reference": y}}


class _Location(msgspec.Struct):
    """``Finding.location`` (checked; kept as a dict): where in the model, or which modules."""

    file: str | None = None
    line: Count | None = None
    module: str | None = None
    module_type: str | None = None
    code: str | None = None
    modules: list[str] = []


def _convert(data: Any, shape: type, where: str = "") -> Any:
    """msgspec's "Expected `str`, got `int` - at `$.cells[0].parameter`" said as ours:
    "malformed flow map: cells[0].parameter: expected `str`, got `int`"."""
    try:
        return msgspec.convert(data, shape, strict=True)
    except msgspec.ValidationError as e:
        text, _, at = str(e).partition(" - at ")
    at = at.replace("`", "").replace("$.", f"{where}." if where else "").replace("$", where or "the flow map")
    if text.startswith("Object missing required field"):
        raise FlowMapFormatError(f"malformed flow map: {at} has no field {text.split('`')[1]!r}") from None
    if "float" in text and text.endswith("got `str`"):
        text += ' (non-finite numbers are written "nan", "inf", "-inf")'
    raise FlowMapFormatError(f"malformed flow map: {at}: {text[:1].lower()}{text[1:]}") from None


_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _float_back(x: Any) -> Any:
    return _NONFINITE.get(x, x) if type(x) is str else x


def _decode_nonfinite(x: Any) -> Any:
    return _NONFINITE.get(x, x) if type(x) is str else _in_items(x, _decode_nonfinite)


def _in_items(x: Any, read: Callable[[Any], Any]) -> Any:
    """``read`` applied to each value of a dict or a list; ``x`` itself when that changed none."""
    if type(x) is dict:
        values = {k: read(v) for k, v in x.items()}
        return x if all(a is b for a, b in zip(values.values(), x.values(), strict=True)) else values
    if type(x) is list:
        items = [read(v) for v in x]
        return x if all(a is b for a, b in zip(items, x, strict=True)) else items
    return x  # not a container: msgspec names what it is


def _in_fields(x: Any, fields: list[tuple[str, Callable[[Any], Any]]]) -> Any:
    """Each field's ``read`` applied to its value in an object; ``x`` itself when that changed none
    (the million cells of a large map are not copied)."""
    out = x
    for name, read in fields if type(x) is dict else ():
        if name in x and (value := read(x[name])) is not x[name]:
            out = dict(x) if out is x else out
            out[name] = value
    return out


def _reader(t: mi.Type) -> Callable[[Any], Any] | None:
    """What puts the floats back in a value of type ``t``: in its float places and free-form data,
    found from the records' types (a string elsewhere stays a string); None where there are none."""
    if isinstance(t, mi.FloatType | mi.AnyType):
        return _float_back if isinstance(t, mi.FloatType) else _decode_nonfinite
    if isinstance(t, mi.UnionType):  # ours are "X | None"
        return next(filter(None, map(_reader, t.types)), None)
    if isinstance(t, mi.DictType | mi.VarTupleType | mi.ListType):
        each = _reader(t.value_type if isinstance(t, mi.DictType) else t.item_type)
        return None if each is None else partial(_in_items, read=each)
    if isinstance(t, mi.StructType):
        fields = [(f.encode_name, r) for f in t.fields if (r := _reader(f.type)) is not None]
        return partial(_in_fields, fields=fields) if fields else None
    return None


_floats_back = _reader(mi.type_info(FlowMap)) or _decode_nonfinite


_JSON_TYPES = ((type(None), "null"), (bool, "a boolean"), (int | float, "a number"), (str, "a string"),
               (Mapping, "an object"), (list | tuple, "a list"))  # fmt: skip


def _json_type(x: Any) -> str:
    return next((name for t, name in _JSON_TYPES if isinstance(x, t)), type(x).__name__)


def _check_schema(schema: Any) -> None:
    if schema == SCHEMA:
        return
    if isinstance(schema, str) and schema.startswith(_SCHEMA_NAME):
        version = schema.removeprefix(_SCHEMA_NAME)
        if version.isdigit() and len(version) < 10 and int(version) > int(SCHEMA.removeprefix(_SCHEMA_NAME)):
            raise FlowMapFormatError(
                f"flow map schema {schema!r} is not supported by this gradprobe (reads {SCHEMA!r}): "
                "it was written by a newer gradprobe; upgrade gradprobe to read it (pip install -U gradprobe)"
            )
    shown = repr(schema[:60]) if isinstance(schema, str) else _json_type(schema)
    raise FlowMapFormatError(f"not a gradprobe flow map: schema is {shown}, expected {SCHEMA!r}")


def _check_depth(data: Any) -> None:
    """Refuse nesting deeper than MAX_DEPTH (msgspec keeps free-form data as it is) and infinities
    (JSON has none). Walked without recursion, holding one iterator per level."""
    stack = [iter((data,))]
    while stack:
        for x in stack[-1]:
            if type(x) is float and math.isinf(x):
                raise FlowMapFormatError(_OUT_OF_RANGE)
            children = x.values() if isinstance(x, Mapping) else x if isinstance(x, list | tuple) else ()
            if children:
                if len(stack) >= MAX_DEPTH:
                    raise FlowMapFormatError(
                        f"malformed flow map: nested more than {MAX_DEPTH} levels deep (gradprobe writes fewer than 10)"
                    )
                stack.append(iter(children))
                break
        else:
            stack.pop()


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
    strings = max(text.count('"') // 2 - keys, 0)
    estimate = 72 * text.count("[") + 160 * text.count("{") + 16 * text.count(":") + 32 * text.count(",")
    estimate += 60 * strings + 8 * keys
    if estimate > MAX_PARSE_FACTOR * n:
        raise FlowMapFormatError(
            f"malformed flow map: too many values for its size ({n:,} bytes holding values that would take "
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
        raise FlowMapFormatError(
            f"malformed flow map: nested too deeply to parse (more than {MAX_DEPTH} levels is refused)"
        ) from None
    except ValueError as e:  # an integer of more than 4300 digits
        raise FlowMapFormatError(f"malformed flow map: a number too large to read ({e})") from None


def _finite(literal: str) -> float:
    """A JSON number as a float; one such as 1e999 would be an infinity, which JSON has not."""
    if math.isinf(value := float(literal)):
        raise FlowMapFormatError(
            f"{_OUT_OF_RANGE} ({literal if len(literal) <= 40 else literal[:37] + '...'})"
        )
    return value


def _reject_constant(name: str) -> Any:
    raise FlowMapFormatError(
        f"flow map is not valid JSON: {name} is not a JSON value (flow maps write non-finite numbers as "
        'the strings "nan", "inf", "-inf")'
    )


def _check_consistency(fm: FlowMap) -> None:
    """What every reader relies on and gradprobe always writes: unique names, scenarios of declared
    terms, a reference among the variants, one run per (variant, scenario) and no other."""
    for kind, names in (("term", fm.terms), ("variant", fm.variant_names), ("scenario", fm.scenario_names)):
        if twice := next((n for n, k in Counter(names).items() if k > 1), None):
            raise FlowMapFormatError(f"malformed flow map: {kind} {twice[:60]!r} appears twice")
    terms, variants, scenarios = set(fm.terms), set(fm.variant_names), set(fm.scenario_names)
    for s in fm.scenarios:
        if unknown := [t for t in s.terms if t not in terms]:
            raise FlowMapFormatError(
                f"malformed flow map: scenario {s.name[:60]!r} switches on {unknown[0][:60]!r}, which is not a term"
            )
    if fm.scenarios and fm.reference not in variants:
        raise FlowMapFormatError(
            f"malformed flow map: the reference variant {fm.reference[:60]!r} is not among the variants"
        )
    runs = Counter((r.variant, r.scenario) for r in fm.runs)
    for (v, s), k in runs.items():
        at = f"variant {v[:60]!r}, scenario {s[:60]!r}"
        if v not in variants or s not in scenarios:
            raise FlowMapFormatError(
                f"malformed flow map: a run of {at}, which the flow map does not declare"
            )
        if k > 1:
            raise FlowMapFormatError(f"malformed flow map: two runs of {at}")
    if len(runs) != len(variants) * len(scenarios):
        v, s = next((v, s) for v in fm.variant_names for s in fm.scenario_names if (v, s) not in runs)
        raise FlowMapFormatError(f"malformed flow map: no run of variant {v[:60]!r}, scenario {s[:60]!r}")


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
