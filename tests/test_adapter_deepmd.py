"""The DeePMD-kit adapter against a real deepmd-kit 3.2 ``pt_expt`` trainer (tiny ``se_e2_a``, float64).

The two ``inductor`` tests are the acceptance tests of issue 8: DeePMD's own compiled path (inductor,
as ``enable_compile`` trains) against its uncompiled path, in the four scenarios, and the same path
with detach stripping turned off, which gradprobe must name ``makefx-detach`` with the lost
parameters. They share one process-wide inductor cache: the bisection's fix (stripping back on) is
the graph the first test compiled. The rest need no compile, or a cheap one.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepmd.pt_expt.train.training", reason="deepmd-kit (pt_expt) is not installed")

import gradprobe.adapters.deepmd as gp_deepmd
from gradprobe.adapters.deepmd import DeepmdAdapter, se_e2_a_config, write_synthetic_system
from gradprobe.build import module_mode
from gradprobe.errors import SpecError
from gradprobe.report.terminal import render

SCENARIOS = ("energy only", "force only", "virial only", "all")
# A per-type constant energy offset moves no atom: the fitting nets' output biases get no gradient
# from forces or virial, in any correct path.
OUTPUT_BIASES = (
    "atomic_model.fitting_net.nets._module_networks.0.layers.2.b",
    "atomic_model.fitting_net.nets._module_networks.1.layers.2.b",
)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> DeepmdAdapter:
    root = tmp_path_factory.mktemp("deepmd")
    system = write_synthetic_system(root / "system")  # no virial.npy: the virial label is synthetic
    return DeepmdAdapter.from_config(se_e2_a_config(system, workdir=root))


@pytest.fixture(scope="module")
def compiled_map(adapter: DeepmdAdapter):  # type: ignore[no-untyped-def]
    return adapter.probe()


def _weights(adapter: DeepmdAdapter, on: tuple[str, ...]) -> dict[str, torch.Tensor]:
    return {t: torch.tensor(float(t in on), dtype=torch.float64) for t in adapter.terms}


def test_isolation_goes_through_deepmds_switches(adapter: DeepmdAdapter) -> None:
    batch = adapter.batch()
    labels = batch["labels"]
    assert batch["coord"].shape == (1, 6, 3) and batch["box"].shape == (1, 3, 3)
    assert "virial" in labels and float(labels["find_virial"]) == 0.0  # the data has no virial
    w = _weights(adapter, ("force",))
    switched = adapter.labels(labels, w, adapter.inputs(batch))
    assert switched["find_force"] is w["force"] and float(switched["find_energy"]) == 0.0
    assert labels["find_energy"] is not switched["find_energy"]  # the batch itself is not modified
    # Each term alone changes the loss; all off gives exactly zero.
    none = adapter.loss(adapter.model, adapter.batch(), _weights(adapter, ()))
    assert float(none) == 0.0
    for t in adapter.terms:
        assert float(adapter.loss(adapter.model, adapter.batch(), _weights(adapter, (t,)))) > 0.0


def test_uncompiled_flow(adapter: DeepmdAdapter) -> None:
    fm = adapter.probe(configurations=["uncompiled"], checks=["training", "physics"])
    # A few optimizer steps per term, on a copy of DeePMD's model, through DeePMD's own loss.
    assert fm.checks["training"]["passed"], fm.checks["training"]
    # DeePMD's forces and virial against finite differences of its energy (float64).
    physics = fm.checks["physics"]
    assert physics["passed"] and physics["force"]["max_rel_error"] < 1e-7, physics
    assert physics["sum_rule"]["relative"] < 1e-12 and physics["virial"]["max_rel_error"] < 1e-7, physics
    assert [v.name for v in fm.variants] == ["deepmd:uncompiled"]
    n = len(fm.trainable)
    assert n == 22
    assert fm.count("deepmd:uncompiled", "energy only") == (22, 22)
    for s in ("force only", "virial only"):
        assert fm.count("deepmd:uncompiled", s) == (20, 22)
        unreached = {p for p in fm.trainable if fm.cell("deepmd:uncompiled", s, p).status != "nonzero"}
        assert unreached == set(OUTPUT_BIASES)
    assert set(adapter.notes) == set(OUTPUT_BIASES)  # explained in the report, not left as a mystery
    assert "per-type energy constant" in render(fm)
    assert not fm.errors()


@pytest.mark.inductor
def test_compiled_path_matches_uncompiled(adapter: DeepmdAdapter, compiled_map) -> None:  # type: ignore[no-untyped-def]
    fm = compiled_map
    assert [v.name for v in fm.variants] == ["deepmd:uncompiled", "deepmd:compiled"]
    for s in SCENARIOS:
        assert fm.count("deepmd:compiled", s) == fm.count("deepmd:uncompiled", s), s
        run = fm.run("deepmd:compiled", s)
        assert run is not None and run.error is None, s
    info = fm.variant("deepmd:compiled")
    assert info.compile_count == 1 and info.graphs == 1  # one compile for the four scenarios
    consistency = fm.checks["consistency"]
    assert consistency["rtol"] == consistency["atol"] == 1e-10
    compiled = consistency["variants"]["deepmd:compiled"]
    assert compiled["passed"] and compiled["checked_cells"] == 88, compiled
    graph = info.graph  # the graph DeePMD compiled, linted: every detach was stripped
    assert graph is not None and graph["nodes"] > 100 and graph["cutting_detach_nodes"] == 0
    assert not fm.errors(), render(fm)


@pytest.mark.inductor
def test_detach_kept_is_named_makefx_detach(adapter: DeepmdAdapter, compiled_map) -> None:  # type: ignore[no-untyped-def]
    del compiled_map  # compiled first: the bisection's fix is then an inductor cache hit
    fm = adapter.probe(detach="keep", diagnose=True)
    errors = fm.errors()
    assert {f.cause for f in errors} == {"makefx-detach"}, render(fm)
    finding = errors[0]
    lost = finding.evidence["lost"]
    assert lost and not set(lost) & set(OUTPUT_BIASES)
    assert all(p in finding.message for p in lost)
    assert all(p.startswith("atomic_model.fitting_net.") and p.endswith(".b") for p in lost)
    bis = finding.evidence["bisection"]
    assert bis["culprit"]["knob"] == "detach" and bis["fix"] == {"variant": "deepmd:compiled", "ok": True}
    assert "strip_saved_tensor_detach" in finding.fix
    assert finding.location and finding.location.get("file", "").endswith(".py")  # a DeePMD source line
    assert fm.count("deepmd:compiled[detach=keep]", "force only")[0] < 20


def test_eval_mode_is_caught_not_measured(adapter: DeepmdAdapter, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeePMD 3.2's compiled model runs its eager original in eval mode: were the adapter to run it so,
    the measurement would compare eager with eager. The compile counter turns that into a failure."""
    monkeypatch.setattr(gp_deepmd, "_train_mode", lambda module: module_mode(module, "eval"))
    fm = adapter.probe(backend="eager")
    for s in SCENARIOS:
        run = fm.run("deepmd:compiled[backend=eager]", s)
        assert run is not None and run.error is not None and "eager original" in run.error.message, s


def test_the_trainer_is_left_as_found(adapter: DeepmdAdapter) -> None:
    import deepmd.pt_expt.train.training as dp_training
    import torch.fx.experimental.proxy_tensor as proxy_tensor

    patched = (
        dp_training._finalize_compiled_lower,
        dp_training._strip_saved_tensor_detach,
        proxy_tensor.make_fx,
    )
    before = {k: v.clone() for k, v in adapter.model.state_dict().items()}
    adapter.model.eval()
    try:
        fm = adapter.probe(backend="eager", detach="keep")  # a real trace and compile, with both patches
        assert not adapter.model.training  # the probe ran it in train mode and put it back
    finally:
        adapter.model.train()
    assert fm.variant("deepmd:compiled[detach=keep,backend=eager]").compile_count == 1
    after = adapter.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in adapter.model.parameters())
    # DeePMD's and torch's functions are their own again.
    assert (
        dp_training._finalize_compiled_lower,
        dp_training._strip_saved_tensor_detach,
        proxy_tensor.make_fx,
    ) == patched
    # The user's trainer keeps its own (uncompiled) wrapper: gradprobe compiled fresh ones.
    assert adapter.trainer.wrapper.model["Default"] is adapter.model


def test_virial_prefactors_are_turned_on(tmp_path) -> None:  # type: ignore[no-untyped-def]
    system = write_synthetic_system(tmp_path / "s", with_virial=True)
    config = se_e2_a_config(system, workdir=tmp_path)
    config["loss"].update(start_pref_v=0.0, limit_pref_v=0.0)
    ad = DeepmdAdapter.from_config(config)
    assert ad.terms == ("energy", "force", "virial") and "virial prefactors" in ad.changes[0]
    assert config["loss"]["start_pref_v"] == 0.0  # the user's dict is not modified
    with pytest.raises(SpecError, match="zero prefactors"):
        DeepmdAdapter.from_config(config, terms=["energy", "virial"], enable_virial=False)


def test_the_example_runs(capsys) -> None:  # type: ignore[no-untyped-def]
    import runpy
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "deepmd_probe.py"
    main = runpy.run_path(str(example))["main"]
    assert main(["--backend", "eager"]) == 0
    out = capsys.readouterr().out
    assert (
        "deepmd:compiled[backend=eager]" in out and "force only:            20/22               20/22" in out
    )


def test_the_training_check_trains_deepmds_compiled_path(adapter: DeepmdAdapter) -> None:
    # build() gets the copy the training check steps: DeePMD's compiled path (aot_eager here, to stay
    # cheap) is trained on that copy, so its terms decrease like the uncompiled path's.
    fm = adapter.probe(backend="aot_eager", checks=["training"])
    verdicts = fm.checks["training"]["verdicts"]
    assert verdicts["deepmd:compiled[backend=aot_eager]"] == verdicts["deepmd:uncompiled"], verdicts
    assert set(verdicts["deepmd:uncompiled"].values()) == {"decreases"}, fm.checks["training"]
    assert not fm.errors(), render(fm)
