"""The flow map as data: JSON round trip, schema checks, queries."""

import json
import math

import pytest
import torch

import gradprobe
from gradprobe.flowmap import SCHEMA, Cell, FlowMap, Run, RunError, ScenarioInfo, VariantInfo


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
        ('{"schema": "gradprobe.flowmap/1"}', "malformed flow map: KeyError"),
    ],
)
def test_bad_files_get_one_clear_error(text, message):
    with pytest.raises(gradprobe.FlowMapFormatError, match=message):
        FlowMap.from_json(text)


def test_bad_status_and_missing_file(fm, tmp_path):
    d = fm.to_dict()
    d["cells"][0]["status"] = "has grad"
    with pytest.raises(gradprobe.FlowMapFormatError, match="unknown status 'has grad'"):
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
    fm = FlowMap(
        **{**fm.__dict__, "runs": (Run("eager", "a only", {}, None, RunError("backward", "X", "m")),)}
    )
    assert FlowMap.from_json(fm.to_json()).runs[0].error == RunError("backward", "X", "m")


def test_a_probes_cells_behave_as_a_tuple_and_are_made_on_first_use():
    # A probe keeps its cells as columns (Cells of CellBlock) and makes Cell objects only when asked:
    # to every reader the sequence is a tuple of the same cells.
    import dataclasses
    import pickle

    from gradprobe.flowmap import Cells, Parameters

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)  # a frozen parameter: its own block of "none" cells

    def step(m, x):
        y = m(x)
        return {"a": y[:, 0].square().mean(), "b": m[2].bias.square().sum()}

    x = torch.randn(5, 3)
    alone = gradprobe.probe(model, step, x, progress=False)
    assert isinstance(alone.cells, Cells) and alone.cells._made is None, "the diagnosis made Cell objects"
    by_status = {k: dict(v) for k, v in alone._by_status.items()}  # read from the columns
    plain = dataclasses.replace(alone, cells=tuple(alone.cells))
    assert {k: dict(v) for k, v in plain._by_status.items()} == by_status
    assert alone.with_status("eager", "b only", "none") == ["0.weight", "2.weight", "0.bias"]  # frozen last
    params = alone.parameters  # likewise kept as columns: the diagnosis read the trainable names only
    assert isinstance(params, Parameters) and params._made is None
    assert alone.trainable == ("0.weight", "2.weight", "2.bias")
    assert [(p.name, p.shape, p.numel, p.requires_grad) for p in params] == [
        ("0.weight", (4, 3), 12, True), ("0.bias", (4,), 4, False), ("2.weight", (2, 4), 8, True), ("2.bias", (2,), 2, True),
    ]  # fmt: skip
    assert (
        pickle.loads(pickle.dumps(params)) == tuple(params)
        and dataclasses.replace(alone, parameters=tuple(params)) == alone
    )

    fm = gradprobe.probe(model, step, x, variants="eager,make_fx", progress=False)
    cells = fm.cells
    assert isinstance(cells, Cells)
    made = tuple(cells)
    assert len(cells) == len(made) == 2 * 3 * 4 and cells == made and made == tuple(cells)
    assert cells[0] is made[0] and cells[-3:] == made[-3:] and cells.index(made[5]) == 5
    assert cells + () == made and () + cells == made and (made[0],) + cells == (made[0], *made)
    assert {c.status for c in cells if c.parameter == "0.bias"} == {"none"}
    assert pickle.loads(pickle.dumps(cells)) == made
    plain = dataclasses.replace(fm, cells=made)
    assert plain == fm and FlowMap.from_json(fm.to_json()) == fm
    assert plain.cells_of("make_fx", "a only") == fm.cells_of("make_fx", "a only")
