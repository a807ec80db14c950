"""NequIP 0.19 probed as its users run it (issue 16): the model compiled alone trains the energy and
names the double backward of forces and stress; make_fx names NequIP's own line; NequIP's own compile
path (CompileGraphModel, through the adapter) matches eager. Skips without nequip."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

pytest.importorskip("nequip")

import gradprobe
from gradprobe.adapters.nequip import NequipAdapter

pytestmark = pytest.mark.real_packages


@pytest.fixture(scope="module")
def adapter() -> NequipAdapter:
    import torch
    import torch._dynamo.config as dynamo_config

    dtype, rng = torch.get_default_dtype(), torch.random.get_rng_state()
    scalars = dynamo_config.capture_scalar_outputs
    made = NequipAdapter.tiny()
    # NequIP's set_global_state (float64, a global seed, dynamo's capture_scalar_outputs) does not leak
    # into the rest of the suite: it changed how SchNetPack compiles (donated buffers instead of the
    # double backward) when the tests ran in one process.
    assert torch.get_default_dtype() == dtype and torch.equal(torch.random.get_rng_state(), rng)
    assert dynamo_config.capture_scalar_outputs == scalars
    return made


def _errors(fm: gradprobe.FlowMap) -> list[str]:
    return sorted({f.cause for f in fm.findings if f.severity == "error"})


def test_the_model_compiled_alone_trains_energy_and_names_the_double_backward(adapter: NequipAdapter) -> None:
    fm = gradprobe.probe(adapter.module(), adapter.terms_of, adapter.batch(),
                         variants="eager,compile_model:aot_eager,make_fx", progress=False)  # fmt: skip
    v = "compile_model:aot_eager"
    assert fm.run(v, "energy only").error is None and not fm.differences(v, "energy only")
    assert fm.count(v, "energy only") == fm.count("eager", "energy only")
    for s in ("force only", "stress only", "all"):
        assert "double backward" in fm.run(v, s).error.message
    (db,) = [f for f in fm.findings if f.cause == "double-backward-unsupported"]
    assert "energy only runs compiled" in db.message
    # The create_graph call in the package's own code (anomaly mode's trace of the failing node).
    assert "site-packages/nequip/" in db.location["file"] and "grad(" in db.location["code"]
    # make_fx fails on a data-dependent value in NequIP's own code, and says where.
    (dd,) = [f for f in fm.findings if f.cause == "data-dependent-trace"]
    assert "site-packages/nequip/" in dd.location["file"] and dd.location["line"] > 0
    assert _errors(fm) == ["data-dependent-trace", "double-backward-unsupported"]


def test_nequips_own_compile_path_matches_eager(adapter: NequipAdapter) -> None:
    fm = adapter.probe(backend="aot_eager", progress=False)
    compiled = "nequip:compile[backend=aot_eager]"
    assert _errors(fm) == [] and fm.exit_code == 0
    for s in fm.scenario_names:
        assert fm.run(compiled, s).error is None and not fm.differences(compiled, s)
        assert fm.count(compiled, s) == fm.count("nequip:eager", s) and fm.count(compiled, s)[0] > 0
    assert set(adapter.terms) == {"energy", "force", "stress"}
    # The adapter built NequIP's CompileGraphModel on the probed parameters: its compiled code ran in
    # every run (dynamo's own events, whoever called torch.compile).
    runs = fm.evidence["dynamo"][compiled]["runs"]
    assert len(runs) == len(fm.scenario_names) and all(w["ran_compiled"] for w in runs.values())


def test_the_terms_are_nequips_own_loss(adapter: NequipAdapter) -> None:
    import torch

    model, batch = adapter.module(), adapter.batch()
    terms = adapter.terms_of(model, batch)
    from gradprobe.adapters.nequip import nequip_settings

    with nequip_settings():
        weighted = adapter.loss_fn(model(dict(batch)), dict(batch))["weighted_sum"]
    assert torch.allclose(sum(terms.values()), weighted)


@pytest.mark.inductor
def test_nequips_own_inductor_compile_matches_eager(adapter: NequipAdapter) -> None:
    fm = adapter.probe(progress=False)  # NequIP's default: inductor
    assert _errors(fm) == [] and fm.exit_code == 0


def test_the_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    example = Path(__file__).resolve().parents[1] / "examples" / "nequip_probe.py"
    assert runpy.run_path(str(example))["main"](["--backend", "aot_eager"]) == 0
    out = capsys.readouterr().out
    assert "nequip:compile[backend=aot_eager]" in out and "no problem found" in out
