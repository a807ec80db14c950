"""The flow map as data: JSON round trip, schema checks, queries."""

import json
import math

import msgspec
import pytest
import torch

import gradprobe
from gradprobe.flowmap import SCHEMA, Cell, FlowMap, ParameterInfo, Run, RunError, ScenarioInfo, VariantInfo


@pytest.fixture(scope="module")
def fm():
    return gradprobe.probe(gradprobe.zoo.reference_spec())


def test_json_round_trip_is_equal(fm, tmp_path):
    path = tmp_path / "f.json"
    fm.to_json(path)
    back = FlowMap.from_json(path)
    assert back == fm
    assert FlowMap.from_json(fm.to_json()) == fm
    assert back.reached("eager", "force only") == fm.reached("eager", "force only")


def test_json_holds_the_schema_fields(fm):
    d = json.loads(fm.to_json())
    for key in ("schema", "torch_version", "device", "dtype", "terms", "scenarios", "variants", "runs",
                "parameters", "cells", "findings"):  # fmt: skip
        assert key in d, key
    assert d["schema"] == SCHEMA == "gradprobe.flowmap/1"
    assert d["scenarios"][0] == {"name": "energy only", "terms": ["energy"]}
    assert d["variants"][0]["name"] == "eager" and d["variants"][0]["error"] is None
    run = d["runs"][0]
    assert set(run) >= {"variant", "scenario", "term_values", "error"}
    assert set(run["term_values"]) == {"energy", "force", "virial"}
    param = d["parameters"][0]
    assert set(param) >= {"name", "shape", "numel", "requires_grad"}
    cell = d["cells"][0]
    assert set(cell) == {"variant", "scenario", "parameter", "status", "norm", "rel_error", "verdict"}
    assert len(d["cells"]) == 4 * 14  # one per (variant, scenario, parameter)
    assert d["findings"][0]["severity"] == "info"


def nonfinite_map():
    return FlowMap(
        torch_version="x", device="cpu", dtype="float32", mode="terms", terms=("a",),
        scenarios=(ScenarioInfo("a only", ("a",)),), variants=(VariantInfo("eager"),),
        runs=(Run("eager", "a only", {"a": math.nan}, math.inf, None),),
        parameters=(), cells=(Cell("eager", "a only", "w", "nan", math.nan), Cell("eager", "a only", "b", "inf", math.inf)),
    )  # fmt: skip


def test_nonfinite_values_survive_strict_json():
    fm = nonfinite_map()
    text = fm.to_json()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    back = FlowMap.from_json(text)
    assert back == fm
    assert math.isnan(back.cell("eager", "a only", "w").norm)
    assert back.cell("eager", "a only", "b").norm == math.inf


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1, 2]", "a flow map is a JSON object"),
        ('{"schema": "gradprobe.flowmap/2"}', "not supported by this gradprobe .*upgrade"),
        ('{"schema": "something/1"}', "not a gradprobe flow map"),
        ('{"schema": "gradprobe.flowmap/1", "torch', "not valid JSON"),
        (
            '{"schema": "gradprobe.flowmap/1"}',
            "malformed flow map: the flow map has no field 'torch_version'",
        ),
    ],
)
def test_bad_files_get_one_clear_error(text, message):
    with pytest.raises(gradprobe.FlowMapFormatError, match=message):
        FlowMap.from_json(text)


def test_bad_status_and_missing_file(fm, tmp_path):
    d = fm.to_dict()
    d["cells"][0]["status"] = "has grad"
    with pytest.raises(
        gradprobe.FlowMapFormatError, match=r"cells\[0\]\.status: invalid enum value 'has grad'"
    ):
        FlowMap.from_dict(d)
    with pytest.raises(gradprobe.FlowMapFormatError, match="cannot read flow map"):
        FlowMap.from_json(tmp_path / "missing.json")


def test_queries(fm):
    assert fm.variant("eager").error is None
    with pytest.raises(KeyError, match="did you mean 'eager'"):
        fm.variant("eagre")
    assert fm.statuses("eager", "force only")["energy_shift"] == "none"
    assert fm.run("eager", "all").error is None
    assert fm.errors() == [] and fm.exit_code == 0


def test_run_error_round_trips():
    fm = nonfinite_map()
    fm = msgspec.structs.replace(fm, runs=(Run("eager", "a only", {}, None, RunError("backward", "X", "m")),))
    assert FlowMap.from_json(fm.to_json()).runs[0].error == RunError("backward", "X", "m")


def test_a_probes_cells_and_parameters_are_plain_tuples_of_records():
    # Every (variant, scenario) run lists its trainable parameters' cells, then its frozen ones ("none").
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)  # a frozen parameter: its cells come last in each run

    def step(m, x):
        y = m(x)
        return {"a": y[:, 0].square().mean(), "b": m[2].bias.square().sum()}

    x = torch.randn(5, 3)
    alone = gradprobe.probe(model, step, x, progress=False)
    assert type(alone.cells) is tuple and all(type(c) is Cell for c in alone.cells)
    assert type(alone.parameters) is tuple and all(type(p) is ParameterInfo for p in alone.parameters)
    assert alone.with_status("eager", "b only", "none") == ["0.weight", "2.weight", "0.bias"]  # frozen last
    assert alone.with_status("eager", "b only", "nonzero", "none") == [
        "2.bias",
        "0.weight",
        "2.weight",
        "0.bias",
    ]
    assert alone.trainable == ("0.weight", "2.weight", "2.bias")
    assert [(p.name, p.shape, p.numel, p.requires_grad, p.dtype) for p in alone.parameters] == [
        ("0.weight", (4, 3), 12, True, "float32"), ("0.bias", (4,), 4, False, "float32"),
        ("2.weight", (2, 4), 8, True, "float32"), ("2.bias", (2,), 2, True, "float32"),
    ]  # fmt: skip
    with pytest.raises(AttributeError):
        alone.cells[0].status = "zero"  # frozen records

    fm = gradprobe.probe(model, step, x, variants="eager,make_fx", progress=False)
    assert len(fm.cells) == 2 * 3 * 4 and type(fm.cells) is tuple
    for v in ("eager", "make_fx"):
        for s in ("a only", "b only", "all"):
            run = [c for c in fm.cells if (c.variant, c.scenario) == (v, s)]
            assert [c.parameter for c in run] == ["0.weight", "2.weight", "2.bias", "0.bias"]
            assert run[-1].status == "none" and run[-1].norm is None and run[-1].verdict is None
            assert all((c.verdict is None) == (v == "eager") for c in run[:-1])
    back = FlowMap.from_json(fm.to_json())
    assert back == fm and back.cells == fm.cells and back.parameters == fm.parameters
    assert back.cells_of("make_fx", "a only") == fm.cells_of("make_fx", "a only")
    assert msgspec.structs.replace(fm, cells=fm.cells[:-1]) != fm
