"""MACE 0.3.16 probed as its users run it (issue 16): MACE's own compile path (``prepare`` then
``torch.compile(fullgraph=True)``, forces traced with ``trace_autograd_ops``) matches eager through the
adapter; the model compiled plainly trains the energy and names the double backward of forces.
mace-torch pins e3nn 0.4.4, so it lives in its own environment (.ci/run); skips without it."""

from __future__ import annotations

import pytest

pytest.importorskip("mace")

import gradprobe
from gradprobe.adapters.mace import MaceAdapter

pytestmark = pytest.mark.real_packages


@pytest.fixture(scope="module")
def adapter() -> MaceAdapter:
    return MaceAdapter.tiny()


def _errors(fm: gradprobe.FlowMap) -> list[str]:
    return sorted({f.cause for f in fm.findings if f.severity == "error"})


def test_maces_own_compile_path_matches_eager(adapter: MaceAdapter) -> None:
    import torch._dynamo.config as dynamo_config

    before = dynamo_config.trace_autograd_ops
    fm = adapter.probe(backend="aot_eager", progress=False)
    compiled = "mace:compile[backend=aot_eager]"
    assert _errors(fm) == [] and fm.exit_code == 0
    for s in fm.scenario_names:
        assert fm.run(compiled, s).error is None and not fm.differences(compiled, s)
        assert fm.count(compiled, s) == fm.count("mace:eager", s)
    runs = fm.evidence["dynamo"][compiled]["runs"]
    assert all(w["ran_compiled"] for w in runs.values())
    # MACE's prepare flips dynamo's trace_autograd_ops for the process: the probe gives it back.
    assert dynamo_config.trace_autograd_ops == before


def test_the_model_compiled_plainly_trains_energy_and_names_the_double_backward(adapter: MaceAdapter) -> None:
    fm = gradprobe.probe(adapter.module(), adapter.terms_of, adapter.batch(),
                         variants="eager,compile_model:aot_eager,make_fx", progress=False)  # fmt: skip
    v = "compile_model:aot_eager"
    assert fm.run(v, "energy only").error is None and not fm.differences(v, "energy only")
    assert all("double backward" in fm.run(v, s).error.message for s in ("force only", "all"))
    (db,) = [f for f in fm.findings if f.cause == "double-backward-unsupported"]
    assert "site-packages/mace/" in db.location["file"] and "grad(" in db.location["code"]
    # make_fx traces MACE exactly (no data-dependent value on this path).
    assert all(
        fm.run("make_fx", s).error is None and not fm.differences("make_fx", s) for s in fm.scenario_names
    )
    assert _errors(fm) == ["double-backward-unsupported"]


def test_the_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    import runpy
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "mace_probe.py"
    assert runpy.run_path(str(example))["main"](["--backend", "aot_eager", "--plain-compile"]) == 0
    out = capsys.readouterr().out
    assert "mace:compile[backend=aot_eager]" in out and "no problem found" in out
    assert "ERROR double-backward-unsupported" in out and "the create_graph gradient is taken at" in out
