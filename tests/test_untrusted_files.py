"""Saved flow maps are untrusted input: read as JSON only, validated, and refused with one clear error.

``FlowMap.from_json`` (and through it ``gradprobe report`` and ``gradprobe diff``) never unpickles or
``torch.load``s; a wrong, truncated, binary, oversized, too deeply nested or future-version file, and a
value of the wrong type anywhere, raise ``FlowMapFormatError`` with a message that says what is wrong,
never a ``TypeError``/``KeyError``/``ValueError``/``RecursionError``. Hypothesis fuzzes the reader with
arbitrary JSON and with mutations of a real saved map.
"""

from __future__ import annotations

import copy
import json
import math
import os
import pickle
import re
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import gradprobe
from gradprobe.cli import main
from gradprobe.errors import FlowMapFormatError
from gradprobe.flowmap import MAX_BYTES, MAX_BYTES_ENV, MAX_DEPTH, SCHEMA, FlowMap

FUZZ_EXAMPLES = int(os.environ.get("GRADPROBE_HYPOTHESIS_EXAMPLES", "0")) or 150
FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(3, 4)
        self.head = nn.Linear(4, 1)
        self.unused = nn.Linear(4, 1)  # an info finding, with evidence

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def two_terms(model: nn.Module, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    y = model(batch)
    return {"fit": y.pow(2).mean(), "reg": model.head.weight.abs().sum()}


@pytest.fixture(scope="module")
def saved() -> FlowMap:
    """A real flow map with every section filled: two variants (verdicts, relative errors), a second
    batch, a training check, findings with evidence, notes."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = TwoHeads()
        batch = torch.randn(8, 3)
    return gradprobe.probe(
        model, two_terms, batch, variants="eager,make_fx", second_batch=batch + 1, checks=["training"],
        diagnose=True, notes={"unused": "a head for later"},
    )  # fmt: skip


@pytest.fixture
def good(saved: FlowMap, tmp_path: Path) -> Path:
    path = tmp_path / "good.json"
    saved.to_json(path)
    return path


def read(source: Any, **kwargs: Any) -> FlowMap | FlowMapFormatError:
    """The reader's outcome: a flow map or its one error type; anything else fails the test."""
    try:
        return FlowMap.from_json(source, **kwargs)
    except FlowMapFormatError as e:
        return e


def refused(source: Any, **kwargs: Any) -> str:
    outcome = read(source, **kwargs)
    assert isinstance(outcome, FlowMapFormatError), f"accepted: {source!r:.200}"
    return str(outcome)


def test_a_real_saved_map_reads_back_equal(saved, good):
    assert saved.variant("make_fx").second_batch is not None and saved.findings and saved.checks
    assert FlowMap.from_json(good) == saved
    assert FlowMap.from_json(good.read_text()) == saved
    assert FlowMap.from_dict(saved.to_dict()) == saved


# ---------------------------------------------------------------------------- whole-file problems
def _dumps(d: Any) -> str:
    return json.dumps(d)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1, 2]", "not a gradprobe flow map: a flow map is a JSON object, got a list"),
        ("{}", "not a gradprobe flow map: schema is null"),
        ('{"schema": "something/1"}', "not a gradprobe flow map: schema is 'something/1'"),
        ('{"schema": 1}', "not a gradprobe flow map: schema is a number, expected 'gradprobe.flowmap/1'"),
        ('{"schema": "gradprobe.flowmap/0"}', "not a gradprobe flow map"),
        ('{"schema": "gradprobe.flowmap/2"}', "not supported by this gradprobe .*newer gradprobe; upgrade"),
        ('{"schema": "gradprobe.flowmap/17", "cells": 5}', "not supported by this gradprobe"),
        ('{"schema": "gradprobe.flowmap/1", "torch', "not valid JSON: truncated"),
        ('{"schema": "gradprobe.flowmap/1", ', "not valid JSON: truncated"),
        ('{"schema": "gradprobe.flowmap/1" "x": 1}', "not valid JSON: Expecting ','"),
        ('{"schema": NaN}', "not valid JSON: NaN is not a JSON value"),
        ('{"rtol": -Infinity}', "not valid JSON: -Infinity is not a JSON value"),
        ("[" * 20_000 + "]" * 20_000, "nested too deeply"),
        # 200 kB of brackets is refused before parsing: it would take 36x its size to hold.
        ("[" * 100_000 + "]" * 100_000, "too many values for its size"),
        ('{"schema": "gradprobe.flowmap/1", "rtol": ' + "9" * 5000 + "}", "a number too large to read"),
        ('{"schema": "gradprobe.flowmap/1", "rtol": 1e999}', r"a number beyond the float range \(1e999\)"),
        ('{"schema": "gradprobe.flowmap/1", "checks": {"x": [[-1E400]]}}', "beyond the float range"),
    ],
)
def test_bad_text_gets_one_clear_error(text, message):
    with pytest.raises(FlowMapFormatError, match=message):
        FlowMap.from_json(text)


def test_truncated_files_say_so(good):
    text = good.read_text()
    for cut in (len(text) // 3, len(text) // 2, len(text) - 3):
        good.write_text(text[:cut])
        assert "truncated" in refused(good)
    good.write_text("")
    assert "empty" in refused(good)


def test_nesting_within_the_parser_limit_is_still_refused(saved):
    d = saved.to_dict()
    deep: Any = 1
    for _ in range(MAX_DEPTH + 5):
        deep = {"x": deep}
    d["checks"] = {"mine": deep}
    assert f"nested more than {MAX_DEPTH} levels" in refused(json.dumps(d))


class Evil:
    """Unpickling this would create a file: the reader must never get that far."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def test_pickles_and_torch_saves_are_never_loaded(saved, tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.json"
    evil.write_bytes(pickle.dumps(Evil(marker)))
    torch_file = tmp_path / "flow.pt"
    torch.save(saved.to_dict(), torch_file)
    binary = tmp_path / "random.json"
    binary.write_bytes(bytes(range(256)) * 4)

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the flow map reader unpickled something")

    for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(module, name, forbidden)
    assert "a Python pickle, not JSON" in refused(evil)
    assert "never unpickles" in refused(evil)
    assert "torch.save" in refused(torch_file)
    assert "not UTF-8 text" in refused(binary)
    assert not marker.exists()
    assert isinstance(read(tmp_path / "good.json"), FlowMapFormatError)  # missing: cannot read
    saved.to_json(tmp_path / "good.json")
    assert read(tmp_path / "good.json") == saved  # the good one still reads, with pickle gone


def test_paths_that_are_not_files(tmp_path):
    assert "cannot read flow map" in refused(tmp_path)  # a directory
    assert "cannot read flow map" in refused(tmp_path / "missing.json")
    assert "cannot read flow map" in refused("bad\0name.json")
    assert "cannot read flow map" in refused("x" * 5000 + ".json")  # name too long


def test_other_sources_are_refused(saved):
    assert "from_json takes JSON text or a path, got bytes" in refused(saved.to_json().encode())
    assert "from_json takes JSON text or a path, got dict" in refused(saved.to_dict())


def test_file_errors_name_the_file(good):
    good.write_text('{"schema": "gradprobe.flowmap/9"}')
    assert refused(good).startswith(f"{good}: flow map schema 'gradprobe.flowmap/9' is not supported")


# ---------------------------------------------------------------------------- size limit
def test_oversized_files_are_refused_before_reading(tmp_path):
    assert MAX_BYTES == 256 * 2**20
    big = tmp_path / "big.json"
    with big.open("wb") as f:
        f.truncate(MAX_BYTES + 1)  # sparse: no disk used, and nothing is read
    message = refused(big)
    assert "over the limit of 268,435,456 bytes (256 MiB)" in message
    assert "max_bytes=N" in message and MAX_BYTES_ENV in message


def test_the_limit_can_be_lowered_and_raised(good, monkeypatch):
    size = good.stat().st_size
    assert "over the limit of 100 bytes" in refused(good, max_bytes=100)
    assert "over the limit of 100 bytes" in refused(good.read_text(), max_bytes=100)
    assert isinstance(read(good, max_bytes=size), FlowMap)
    monkeypatch.setenv(MAX_BYTES_ENV, "100")
    assert "over the limit of 100 bytes" in refused(good)
    assert isinstance(read(good, max_bytes=size), FlowMap)  # the parameter wins
    monkeypatch.setenv(MAX_BYTES_ENV, "lots")
    assert f"{MAX_BYTES_ENV} must be a positive number of bytes" in refused(good)
    monkeypatch.delenv(MAX_BYTES_ENV)
    assert "max_bytes must be a positive integer" in refused(good, max_bytes=0)


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_device_without_a_size_is_read_no_further_than_the_limit():
    assert "over the limit of 1,000 bytes" in refused("/dev/zero", max_bytes=1000)


# ---------------------------------------------------------------------------- wrong types anywhere
def _set(d: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    d = copy.deepcopy(d)
    target: Any = d
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return d


WRONG_TYPES = [
    (("torch_version",), 12, "torch_version: expected `str`, got `int`"),
    (("mode",), "both", "mode: invalid enum value 'both'"),
    (("terms",), "fit", "terms: expected `array`, got `str`"),
    (("terms", 0), 1, r"terms\[0\]: expected `str`, got `int`"),
    (("scenarios", 0), ["fit only"], r"scenarios\[0\]: expected `object`, got `array`"),
    (("scenarios", 0, "terms"), "fit", r"scenarios\[0\].terms: expected `array`, got `str`"),
    (("variants", 0, "knobs"), [], r"variants\[0\].knobs: expected `object`, got `array`"),
    (("variants", 0, "seconds"), "fast", r"variants\[0\].seconds: expected `float`, got `str`"),
    (("variants", 0, "compile_count"), -1, r"variants\[0\].compile_count: expected `int` >= 0"),
    (
        ("variants", 1, "second_batch", "mismatched"),
        "body.weight",
        r"variants\[1\].second_batch.mismatched: expected `array`, got `str`",
    ),
    (("variants", 1, "second_batch", "scenario"), None, "second_batch.scenario: expected `str`, got `null`"),
    (("runs", 0, "error"), "boom", r"runs\[0\].error: expected `object \| null`, got `str`"),
    (("runs", 0, "term_values"), {"fit": "NaN"}, r"term_values\[...\]: expected `float \| null`, got `str`"),
    (("runs", 0, "term_values"), {"fit": [1]}, r"term_values\[...\]: expected `float \| null`, got `array`"),
    (("runs", 0, "compiled_graphs"), 1.5, r"runs\[0\].compiled_graphs: expected `int \| null`, got `float`"),
    (("parameters", 0, "numel"), "nan", r"parameters\[0\].numel: expected `int`, got `str`"),
    (("parameters", 0, "numel"), True, r"parameters\[0\].numel: expected `int`, got `bool`"),
    (("parameters", 0, "shape"), ["nan"], r"shape\[0\]: expected `int`, got `str`"),
    (("parameters", 0, "shape", 0), 2**70, r"shape\[0\]: expected `int` <= 9223372036854775807"),
    (("parameters", 0, "requires_grad"), "nan", "requires_grad: expected `bool`, got `str`"),
    (("parameters", 0, "requires_grad"), 1, "requires_grad: expected `bool`, got `int`"),
    (("cells", 0, "status"), "has grad", r"cells\[0\].status: invalid enum value 'has grad'"),
    (("cells", 0, "status"), 3, r"cells\[0\].status: expected `str`, got `int`"),
    (("cells", 0, "norm"), {"l1": 1}, r"cells\[0\].norm: expected `float \| null`, got `object`"),
    (("cells", 0, "norm"), 10**400, r"cells\[0\].norm: number out of range"),
    (("cells", 0, "parameter"), None, r"cells\[0\].parameter: expected `str`, got `null`"),
    (("cells", 4, "verdict"), "great", r"cells\[4\].verdict: invalid enum value 'great'"),
    (("findings", 0, "severity"), "fatal", r"findings\[0\].severity: invalid enum value 'fatal'"),
    (("findings", 0, "evidence"), "none", r"findings\[0\].evidence: expected `object`, got `str`"),
    (("findings", 0, "references"), [None], r"references\[0\]: expected `str`, got `null`"),
    (("notes",), {"unused": 1}, r"notes\[...\]: expected `str`, got `int`"),
    (("notes",), ["unused"], "notes: expected `object`, got `array`"),
    (("rtol",), True, r"rtol: expected `float \| null`, got `bool`"),
    (("rtol",), "1e-7", r"rtol: expected `float \| null`, got `str`"),
    (("warnings",), "careful", "warnings: expected `array`, got `str`"),
    (("bisections",), {"a": 1}, "bisections: expected `array`, got `object`"),
    (("breaks",), [1], r"breaks\[0\]: expected `object`, got `int`"),
    (("checks",), [], "checks: expected `object`, got `array`"),
    (("cells",), None, "cells: expected `array`, got `null`"),
    (
        ("reference",),
        "compile:inductor",
        "the reference variant 'compile:inductor' is not among the variants",
    ),
    (("scenarios", 0, "terms"), ["energy"], "switches on 'energy', which is not a term"),
    (("runs", 0, "variant"), "make_fx", "two runs of variant 'make_fx'"),
    (
        ("runs", 0, "scenario"),
        "mystery",
        "a run of variant 'eager', scenario 'mystery', which the flow map does not",
    ),
    (("variants", 1, "name"), "eager", "variant 'eager' appears twice"),
]


@pytest.mark.parametrize(
    ("path", "value", "message"), WRONG_TYPES, ids=[".".join(map(str, w[0])) for w in WRONG_TYPES]
)
def test_a_wrong_value_anywhere_is_named(saved, path, value, message):
    d = _set(saved.to_dict(), path, value)
    with pytest.raises(FlowMapFormatError, match=message):
        FlowMap.from_dict(d)
    with pytest.raises(FlowMapFormatError, match=message):
        FlowMap.from_json(json.dumps(d))


REQUIRED = (
    "torch_version",
    "device",
    "dtype",
    "mode",
    "terms",
    "scenarios",
    "variants",
    "runs",
    "parameters",
    "cells",
)


@pytest.mark.parametrize("key", REQUIRED)
def test_a_missing_field_is_named(saved, key):
    d = saved.to_dict()
    del d[key]
    with pytest.raises(FlowMapFormatError, match=f"malformed flow map: the flow map has no field '{key}'"):
        FlowMap.from_dict(d)


def test_missing_runs_and_fields_inside_entries_are_named(saved):
    d = saved.to_dict()
    del d["runs"][0]
    assert "no run of variant 'eager'" in refused(json.dumps(d))
    d = saved.to_dict()
    del d["cells"][0]["status"]
    assert "cells[0] has no field 'status'" in refused(json.dumps(d))


def test_optional_fields_may_be_missing_and_unknown_fields_are_ignored(saved):
    d = saved.to_dict()
    for key in ("gradprobe_version", "findings", "notes", "reference", "rtol", "warnings", "bisections", "breaks", "checks"):  # fmt: skip
        d.pop(key)
    d["added_by_a_later_version"] = {"anything": [1, 2]}
    d["cells"][0]["also_new"] = True
    fm = FlowMap.from_dict(d)
    assert fm.findings == () and fm.reference == "eager" and fm.checks == {}


def test_nonfinite_numbers_in_checks_come_back_as_numbers(saved):
    # to_json writes inf as "inf" everywhere; the reader turns it back into a float where it measured
    # something, so reports format it as they did before saving.
    training = dict(saved.checks["training"])
    training["divergence_from_reference"] = {"make_fx": math.inf}
    fm = msgspec.structs.replace(saved, checks={**saved.checks, "training": training})
    back = FlowMap.from_json(fm.to_json())
    assert back == fm
    assert back.checks["training"]["divergence_from_reference"]["make_fx"] == math.inf
    gradprobe.render(back)  # formats the number; a string "inf" could not be formatted


# ---------------------------------------------------------------------------- fuzzing
KEYS = ["schema", "torch_version", "device", "dtype", "mode", "terms", "scenarios", "variants", "runs",
        "parameters", "cells", "findings", "notes", "reference", "rtol", "warnings", "bisections", "breaks",
        "checks", "name", "status", "norm", "variant", "scenario", "parameter", "shape", "numel",
        "requires_grad", "error", "stage", "type", "message", "severity", "cause", "second_batch"]  # fmt: skip
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | st.sampled_from(
        ["nan", "inf", "-inf", SCHEMA, "gradprobe.flowmap/2", "terms", "eager", "all", "nonzero"]
    )
)
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), children, max_size=6)
    ),
    max_leaves=40,
)


def _check_outcome(outcome: FlowMap | FlowMapFormatError) -> None:
    if isinstance(outcome, FlowMap):  # accepted: it must serialise and read back equal
        assert FlowMap.from_json(outcome.to_json()) == outcome


@FUZZ
@given(json_values)
def test_fuzz_arbitrary_json(value):
    text = json.dumps(value)
    if text.lstrip()[:1] in ("{", "["):
        _check_outcome(read(text))
    outcome: FlowMap | FlowMapFormatError
    try:
        outcome = FlowMap.from_dict(value)
    except FlowMapFormatError as e:
        outcome = e
    _check_outcome(outcome)


@FUZZ
@given(st.dictionaries(st.sampled_from(KEYS), json_values, max_size=12))
def test_fuzz_flow_map_shaped_objects(fields):
    _check_outcome(read(json.dumps({"schema": SCHEMA, **fields})))


def _paths(x: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(x, dict):
        for k, v in x.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            out += _paths(v, (*prefix, i))
    return out


@FUZZ
@given(data=st.data())
def test_fuzz_mutations_of_a_real_map(saved, data):
    d = saved.to_dict()
    paths = _paths(d)[1:]
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        path = data.draw(st.sampled_from(paths), label="path")
        parent: Any = d
        try:
            for key in path[:-1]:
                parent = parent[key]
            action = data.draw(st.sampled_from(["drop", "replace", "wrap"]), label="action")
            if action == "drop":
                del parent[path[-1]]
            elif action == "replace":
                parent[path[-1]] = data.draw(json_values, label="value")
            else:
                parent[path[-1]] = [parent[path[-1]]]
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed or replaced this place
    _check_outcome(read(json.dumps(d)))


@FUZZ
@given(data=st.data())
def test_fuzz_text_damage_to_a_real_file(saved, data):
    text = saved.to_json()
    damage = data.draw(st.sampled_from(["truncate", "replace", "delete", "insert"]), label="damage")
    at = data.draw(st.integers(0, len(text) - 1), label="at")
    if damage == "truncate":
        text = text[:at]
    elif damage == "replace":
        text = text[:at] + data.draw(st.characters(), label="char") + text[at + 1 :]
    elif damage == "delete":
        text = text[:at] + text[at + data.draw(st.integers(1, 50), label="n") :]
    else:
        text = text[:at] + data.draw(st.text(max_size=5), label="text") + text[at:]
    _check_outcome(read(text) if text.lstrip()[:1] in ("{", "[") else _read_text_as_file(text))


def _read_text_as_file(text: str) -> FlowMap | FlowMapFormatError:
    import tempfile

    with tempfile.NamedTemporaryFile(
        "w", suffix=".json", encoding="utf-8", errors="surrogatepass", delete=False
    ) as f:
        f.write(text)
    try:
        return read(Path(f.name))
    finally:
        os.unlink(f.name)


# ---------------------------------------------------------------------------- the command line
BAD_FILES = {
    "not JSON": ("flow map\n", "not valid JSON"),
    "truncated": ('{"schema": "gradprobe.flowmap/1", "terms": ["a"', "not valid JSON: truncated"),
    "future version": ('{"schema": "gradprobe.flowmap/3"}', "not supported by this gradprobe"),
    "another schema": ('{"schema": "wandb/1"}', "not a gradprobe flow map"),
    "wrong type": (None, "torch_version: expected `str`, got `float`"),
    "pickle": (b"\x80\x04K\x01.", "never unpickles"),
}


def _write_bad(tmp_path: Path, kind: str, saved: FlowMap) -> Path:
    content, _ = BAD_FILES[kind]
    path = tmp_path / "bad.json"
    if content is None:
        path.write_text(json.dumps({**saved.to_dict(), "torch_version": 2.13}))
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


@pytest.mark.parametrize("kind", list(BAD_FILES))
def test_cli_report_and_diff_exit_2_with_the_message(kind, saved, good, tmp_path, capsys):
    bad = _write_bad(tmp_path, kind, saved)
    message = BAD_FILES[kind][1]
    for argv in (["report", str(bad)], ["diff", str(bad), str(good)], ["diff", str(good), str(bad)]):
        assert main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert err.startswith(f"gradprobe: error: {bad}: "), err
        assert message in err, err
        assert "Traceback" not in err and out == ""


def test_cli_report_obeys_the_size_limit(good, monkeypatch, capsys):
    monkeypatch.setenv(MAX_BYTES_ENV, "64")
    assert main(["report", str(good)]) == 2
    assert (
        f"over the limit of 64 bytes (0 MiB) for a flow map: not read. If you trust it, raise the limit: FlowMap.from_json(..., max_bytes=N) or the environment variable {MAX_BYTES_ENV}=N"
        in capsys.readouterr().err
    )


def test_cli_reads_good_files(saved, good, capsys):
    assert main(["report", str(good)]) == saved.exit_code
    assert "fit only" in capsys.readouterr().out
    assert main(["diff", str(good), str(good)]) == 0


def test_the_reader_does_not_import_anything_that_deserialises_objects():
    source = Path(sys.modules[FlowMap.__module__].__file__).read_text()
    imports = re.findall(r"^\s*(?:from|import) ([\w.]+)", source, flags=re.MULTILINE)
    assert set(imports) <= {"__future__", "json", "math", "os", "collections", "collections.abc", "dataclasses",
                            "functools", "itertools", "operator", "pathlib", "typing", "msgspec", "msgspec.inspect",
                            ".compare", ".errors", ".status"}, imports  # fmt: skip
    for call in ("pickle.", "torch.load", "marshal.", "eval(", "exec(", "__import__"):
        assert call not in source, call


# ---------------------------------------------------------------------------- control characters
# Clears the screen, moves the cursor home and prints a fake verdict; a bell, a carriage return, a C1
# control sequence introducer, a right-to-left override, a NUL.
CONTROLS = "\x1b[2J\x1b[Hgradprobe: OK: no problem found\x07\r\x9b31m\u202eevil\x00"
RAW = ("\x1b", "\x07", "\r", "\x9b", "\u202e", "\x00")


def _with_controls(saved: FlowMap) -> FlowMap:
    d = json.loads(saved.to_json())
    name = d["parameters"][0]["name"]
    for p in d["parameters"]:
        if p["name"] == name:
            p["name"] += CONTROLS
    for c in d["cells"]:
        if c["parameter"] == name:
            c["parameter"] += CONTROLS
    d["findings"][0]["message"] += CONTROLS
    d["findings"][0]["fix"] += CONTROLS
    d["notes"] = {CONTROLS: CONTROLS}
    d["warnings"] = [CONTROLS]
    d["torch_version"] += CONTROLS
    d["runs"][0]["error"] = {"stage": "forward", "type": "RuntimeError" + CONTROLS, "message": CONTROLS}
    return FlowMap.from_json(json.dumps(d))  # "\u001b" in the JSON text: a raw ESC once read


def test_control_characters_from_a_file_never_reach_the_output_raw(saved, tmp_path, capsys):
    from gradprobe.flowdiff import diff_maps
    from gradprobe.report.html import render_html
    from gradprobe.report.markdown import render_markdown

    evil = _with_controls(saved)
    outputs = {
        "terminal": gradprobe.render(evil, show_all=True),
        "markdown": render_markdown(evil),
        "html": render_html(evil),
        "diff": diff_maps(saved, evil).render() + diff_maps(evil, saved).render(),
    }
    path = tmp_path / "evil.json"
    evil.to_json(path)
    main(["report", str(path)])
    before = tmp_path / "good.json"
    saved.to_json(before)
    main(["diff", str(before), str(path)])
    captured = capsys.readouterr()
    outputs["cli"] = captured.out + captured.err
    for kind, text in outputs.items():
        assert not [c for c in RAW if c in text], kind
        assert "\\x1b" in text, kind  # shown, escaped
