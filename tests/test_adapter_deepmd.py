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
    # Each term alone changes the loss; all off gives exactly zero. (loss() returns DeePMD's metrics too.)
    none, _, _ = adapter.loss(adapter.model, adapter.batch(), _weights(adapter, ()))
    assert float(none) == 0.0
    for t in adapter.terms:
        loss, terms, metrics = adapter.loss(adapter.model, adapter.batch(), _weights(adapter, (t,)))
        assert float(loss) > 0.0 and terms == {} and {"rmse_e", "rmse_f", "rmse_v"} <= set(metrics)


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
    # DeePMD's reported metrics agree with gradprobe's recomputation by the documented definitions.
    metrics = fm.checks["metrics"]
    assert metrics["passed"] and metrics["natoms"] == 6, metrics
    assert set(metrics["paths"]["pt_expt"]) == {"rmse_e", "rmse_f", "rmse_v", "rmse"}
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
    assert consistency["rtol"] == 1e-10
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
    the measurement would compare eager with eager. The compile counter turns that into a failure,
    which says it was eval mode; and the reference, whose forces then reach nothing, is an error of
    its own."""
    monkeypatch.setattr(gp_deepmd, "_train_mode", lambda module: module_mode(module, "eval"))
    fm = adapter.probe(backend="eager")
    for s in SCENARIOS:
        run = fm.run("deepmd:compiled[backend=eager]", s)
        assert run is not None and run.error is not None and "eager original" in run.error.message, s
        assert "the wrapper was in eval mode" in run.error.message
    on_reference = [f for f in fm.errors() if (f.location or {}).get("variant") == "deepmd:uncompiled"]
    assert {f.cause for f in on_reference} == {"dead-term"}, render(fm)
    assert {f.location["term"] for f in on_reference} == {"force", "virial"}


def test_a_type_absent_from_the_batch_is_said_in_words(tmp_path) -> None:  # type: ignore[no-untyped-def]
    system = write_synthetic_system(tmp_path / "s")
    (system / "type.raw").write_text("0\n" * 6)  # oxygen only; the type map still has H
    ad = DeepmdAdapter.from_config(se_e2_a_config(system, workdir=tmp_path))
    assert ad.types_present() == ["O"]
    fm = ad.probe(configurations=["uncompiled"])
    out = render(fm)
    assert "type H is absent from the batch (types present: O): its fitting net gets no gradient" in out
    h_net = "atomic_model.fitting_net.nets._module_networks.1.layers.0.w"
    assert fm.count("deepmd:uncompiled", "energy only")[0] < 22 and h_net not in fm.reached(
        "deepmd:uncompiled", "all"
    )
    assert not fm.errors(), out


def test_gradprobe_run_takes_a_deepmd_input_json(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import json

    from gradprobe.cli import main

    write_synthetic_system(tmp_path / "data" / "water")
    config = se_e2_a_config("data/water", workdir=tmp_path)  # relative to the input file, as DeePMD reads it
    (tmp_path / "input.json").write_text(json.dumps(config))
    saved = tmp_path / "fm.json"
    argv = ["run", str(tmp_path / "input.json"), "--variants", "uncompiled", "--check", "backends"]
    assert main([*argv, "--json", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "deepmd:uncompiled" in out and "energy only:           22/22" in out
    # DeePMD's own checks from the command line: its metrics always, pt vs pt_expt when asked for.
    checks = json.loads(saved.read_text())["checks"]
    assert checks["metrics"]["passed"] and checks["backends"]["passed"], checks


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


COMPILED = "deepmd:compiled[backend=aot_eager]"  # aot_eager: DeePMD's own path, a cheap compile


@pytest.fixture(scope="module")
def checked_map(adapter: DeepmdAdapter):  # type: ignore[no-untyped-def]
    return adapter.probe(backend="aot_eager", checks=["training", "physics"])


def test_the_training_check_trains_deepmds_compiled_path(checked_map) -> None:  # type: ignore[no-untyped-def]
    # build() gets the copy the training check steps: DeePMD's compiled path is trained on that copy,
    # its compiled graph ran in every step (its counter), the copy moved, every term decreases.
    fm = checked_map
    training = fm.checks["training"]
    verdicts = training["verdicts"]
    assert verdicts[COMPILED] == verdicts["deepmd:uncompiled"] == dict.fromkeys(fm.terms, "decreases"), (
        training
    )
    assert training["compiled_steps"][COMPILED] == dict.fromkeys(fm.terms, training["steps"] + 1)
    assert all(m > 0 for v in (COMPILED, "deepmd:uncompiled") for m in training["moved"][v].values())
    assert not fm.errors(), render(fm)


def test_physics_and_outputs_are_checked_on_the_compiled_path_too(checked_map) -> None:  # type: ignore[no-untyped-def]
    mine = checked_map.checks["physics_paths"][COMPILED]
    assert mine["passed"] and mine["force"]["max_rel_error"] < 1e-7 and mine["virial"]["max_rel_error"] < 1e-7
    assert all(e < 1e-10 for e in mine["outputs"].values()), mine["outputs"]  # vs deepmd:uncompiled's
    # DeePMD's own metrics are recorded per run and path.
    run = checked_map.run(COMPILED, "force only")
    assert run.metrics["rmse_f"] == pytest.approx(
        checked_map.run("deepmd:uncompiled", "force only").metrics["rmse_f"]
    )


def _errors_of(fm) -> set[str]:  # type: ignore[no-untyped-def]
    return {f.cause for f in fm.errors()}


def test_a_ghost_slice_in_the_compiled_fold_is_named_on_the_compiled_path(
    adapter: DeepmdAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Injected at run time: the compiled path's fold slices the extended forces instead of
    # scatter-summing them onto their local atoms (DeePMD's eager fold is left alone).
    import deepmd.pt_expt.train.training as dp_training

    compiled_model = dp_training._CompiledModel
    lower_for, forward = compiled_model._compiled_lower_for, compiled_model.forward
    seen: list[dict] = []

    def capturing(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        graph, order = lower_for(self, *args, **kwargs)

        def run(*a):  # type: ignore[no-untyped-def]
            out = graph(*a)
            seen.append(out)
            return out

        return run, order

    def sliced(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = forward(self, *args, **kwargs)
        if "force" in out and seen:
            out["force"] = seen[-1]["extended_force"][:, : out["force"].shape[1]]  # the bug
        return out

    monkeypatch.setattr(compiled_model, "_compiled_lower_for", capturing)
    monkeypatch.setattr(compiled_model, "forward", sliced)
    fm = adapter.probe(backend="aot_eager", checks=["physics"])
    assert fm.checks["physics"]["passed"]  # the reference is right
    (f,) = [f for f in fm.findings if f.cause == "ghost-force-slice"]
    assert f.location["variant"] == COMPILED and f.message.startswith(f"{COMPILED}:")
    assert _errors_of(fm) == {"ghost-force-slice"}, render(fm)


def _edit_fold(monkeypatch: pytest.MonkeyPatch, module_name: str, edit) -> None:  # type: ignore[no-untyped-def]
    """A fault injected into a DeePMD backend's ``communicate_extended_output`` (the fold of extended
    atoms' outputs onto local ones): ``edit(out, model_ret)`` changes its output in place."""
    import importlib

    module = importlib.import_module(module_name)
    fold = module.communicate_extended_output

    def edited(model_ret, model_output_def, mapping, do_atomic_virial=False):  # type: ignore[no-untyped-def]
        out = fold(model_ret, model_output_def, mapping, do_atomic_virial)
        edit(out, model_ret)
        return out

    monkeypatch.setattr(module, "communicate_extended_output", edited)


def test_a_ghost_slice_in_the_eager_fold_is_named_on_the_reference(
    adapter: DeepmdAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    def sliced(out, model_ret):  # type: ignore[no-untyped-def]
        out["energy_derv_r"] = model_ret["energy_derv_r"][:, : model_ret["energy"].shape[1]]  # the bug

    _edit_fold(monkeypatch, "deepmd.dpmodel.model.make_model", sliced)
    fm = adapter.probe(backend="aot_eager", checks=["physics"])
    (f,) = [f for f in fm.findings if f.cause == "ghost-force-slice"]
    assert f.location["variant"] == "deepmd:uncompiled", f.message
    assert fm.checks["physics_paths"][COMPILED]["force"]["max_rel_error"] < 1e-7  # the compiled fold is right
    assert _errors_of(fm) == {"ghost-force-slice"}, render(fm)
    # The compiled path differs from a reference that is wrong: said, as a warning, not blamed.
    differ = [f for f in fm.findings if f.cause in ("outputs-differ", "flow-mismatch")]
    assert differ and all(f.severity == "warning" for f in differ)


def test_an_rmse_normalisation_fault_is_named_with_the_factor_natoms(
    adapter: DeepmdAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    call = DeepmdAdapter._call

    def faulty(self, wrapper, batch, weights, counter=None):  # type: ignore[no-untyped-def]
        loss, terms, metrics = call(self, wrapper, batch, weights, counter)
        if counter is not None:  # the compiled path only: rmse_v not divided by the atom count
            metrics = {**metrics, "rmse_v": metrics["rmse_v"] * batch["atype"].shape[-1]}
        return loss, terms, metrics

    monkeypatch.setattr(DeepmdAdapter, "_call", faulty)
    fm = adapter.probe(backend="aot_eager")
    (f,) = [f for f in fm.findings if f.cause == "norm-mismatch"]
    natoms = adapter.batch()["atype"].shape[-1]
    assert f.evidence["metric"] == "rmse_v" and f.evidence["factor"] == pytest.approx(natoms)
    assert f.evidence["variant"] == COMPILED and "not a trained term" in f.message


def test_balance_is_judged_at_the_prefactors_of_deepmds_schedule(adapter: DeepmdAdapter) -> None:
    # At DeePMD's first step the energy prefactor is 0.02 against the force's 1000: the energy is
    # drowned now by design; at the schedule's end (limit prefactors) it is not. Said so, as information.
    fm = adapter.probe(configurations=["uncompiled"], checks=["balance"])
    schedule = fm.checks["balance"]["prefactor_schedule"]
    assert schedule["now"]["energy"] == pytest.approx(0.02, rel=0.05) and schedule["limit"]["energy"] == 1.0
    dominated = {f.location["term"]: f for f in fm.findings if f.cause == "term-dominated"}
    energy = dominated["energy"]
    assert energy.severity == "info" and "by design of the schedule" in energy.message, energy.message
    assert "current step (lr" in energy.message and "nothing to do" in energy.fix
    # The virial's prefactor does not move (1 → 1): drowned by the force at the limit too, still a warning.
    if "virial" in dominated:
        assert (
            dominated["virial"].severity == "warning" and "still drowned there" in dominated["virial"].message
        )
    assert not fm.errors(), render(fm)


# ---- DeePMD's metrics by their documented definitions; the pt backend against pt_expt (issue 33 item 4) ----


def test_deepmds_metrics_are_recomputed_by_the_documented_definitions(adapter: DeepmdAdapter) -> None:
    from gradprobe.adapters.deepmd import documented_metrics

    result = adapter.check_metrics()
    rows = result["paths"]["pt_expt"]
    assert result["passed"] and set(rows) == {"rmse_e", "rmse_f", "rmse_v", "rmse"}, result
    assert all(abs(r["factor"] - 1.0) < 1e-12 for r in rows.values()), rows
    # The definitions themselves, on numbers worked by hand: 2 frames of 4 atoms.
    pred = {"energy": torch.tensor([[3.0], [1.0]]), "force": torch.ones(2, 4, 3), "virial": torch.zeros(2, 9)}
    labels = {
        "energy": torch.tensor([[1.0], [1.0]]),
        "force": torch.zeros(2, 12),
        "virial": torch.full((2, 9), 2.0),
    }
    ours = documented_metrics(pred, labels, natoms=4)
    assert ours == pytest.approx({"rmse_e": (2.0**0.5) / 4, "rmse_f": 1.0, "rmse_v": 2.0 / 4})


def test_the_aggregate_rmse_holds_every_term_the_loss_computes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Virial probed or not: with virial labels in the data, DeePMD's loss (and so its rmse) holds it.
    system = write_synthetic_system(tmp_path / "s", with_virial=True)
    ad = DeepmdAdapter.from_config(se_e2_a_config(system, workdir=tmp_path), terms=["energy", "force"])
    result = ad.check_metrics()
    assert result["passed"] and "rmse" in result["paths"]["pt_expt"], result


def test_an_rmse_v_fault_in_deepmds_shared_loss_is_named_with_the_factor_natoms(
    adapter: DeepmdAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The seed's bug in its real form: rmse_v not divided by the atom count, in the loss that both of
    # pt_expt's paths share (3.2.0 has the fix: injected here).
    from deepmd.dpmodel.loss.ener import EnergyLoss

    call = EnergyLoss.call

    def unnormalised(self, learning_rate, natoms, model_dict, label_dict, *args, **kwargs):  # type: ignore[no-untyped-def]
        loss, more = call(self, learning_rate, natoms, model_dict, label_dict, *args, **kwargs)
        if "rmse_v" in more:
            more["rmse_v"] = more["rmse_v"] * natoms  # the bug: sqrt(mse_v), not sqrt(mse_v) / natoms
        return loss, more

    monkeypatch.setattr(EnergyLoss, "call", unnormalised)
    fm = adapter.probe(backend="eager")  # DeePMD's compiled path, the cheapest backend
    # Both paths report the same wrong value: comparing them sees nothing ...
    assert fm.run("deepmd:compiled[backend=eager]", "all").metrics["rmse_v"] == pytest.approx(
        fm.run("deepmd:uncompiled", "all").metrics["rmse_v"]
    )
    # ... the documented definition does.
    (f,) = [f for f in fm.findings if f.cause == "norm-mismatch"]
    natoms = adapter.batch()["atype"].shape[-1]
    assert f.evidence["metric"] == "rmse_v" and f.evidence["path"] == "pt_expt" and f.severity == "error"
    assert (
        f.evidence["factor"] == pytest.approx(natoms) and f.evidence["factor_named"] == f"natoms = {natoms}"
    )
    assert f"the factor is natoms = {natoms}" in f.message and "rmse_v reported by pt_expt" in f.message
    assert fm.checks["metrics"]["paths"]["pt_expt"]["rmse_e"]["passed"]  # only rmse_v is off
    assert f"rmse_v ×{natoms}" in render(fm)
    # The claim rests on the recorded check: on other evidence it no longer holds.
    import msgspec

    from gradprobe.claims import holds

    (c,) = f.claims
    assert c.kind == "metric_recomputed" and holds(fm, c)
    other = {**fm.checks["metrics"], "natoms": natoms + 1}
    assert not holds(msgspec.structs.replace(fm, checks={**fm.checks, "metrics": other}), c)
    assert _errors_of(fm) == {"norm-mismatch"}, render(fm)


def test_pt_and_pt_expt_agree_on_the_healthy_model(adapter: DeepmdAdapter) -> None:
    from gradprobe.adapters.deepmd import GRAD_RTOL, OUTPUT_RTOL

    before = {k: v.clone() for k, v in adapter.model.state_dict().items()}
    fm = adapter.probe(configurations=["uncompiled"], checks=["backends"])
    result = fm.checks["backends"]
    assert result["passed"], result["failures"]
    assert set(result["outputs"]) == {"energy", "force", "virial"}
    assert all(e <= OUTPUT_RTOL for e in result["outputs"].values()), result["outputs"]
    for term in ("energy", "force", "virial"):
        g = result["grads"][term]
        assert len(g["variables"]) == 22 and g["max_rel_error"] <= GRAD_RTOL, (term, g["max_rel_error"])
    assert result["unmatched"] == []
    # Each backend's own loss against the documented definitions: both agree with them.
    assert result["metrics"]["passed"] and set(result["metrics"]["paths"]) == {"pt_expt", "pt"}
    assert not [f for f in fm.findings if f.cause in ("backends-differ", "norm-mismatch")]
    out = render(fm)
    assert "backends, pt vs pt_expt (serialize()/deserialize()): PASS" in out, out
    assert "metrics vs their documented definitions (natoms 6, within 1e-06): PASS" in out, out
    assert not fm.errors(), out
    after = adapter.model.state_dict()  # measured on copies: the probed model is as it was
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in adapter.model.parameters())


def test_a_float32_model_is_compared_at_float32_tolerances(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from gradprobe.adapters.deepmd import FLOAT32_RTOLS

    system = write_synthetic_system(tmp_path / "s")
    ad = DeepmdAdapter.from_config(se_e2_a_config(system, workdir=tmp_path, precision="float32"))
    result = ad.compare_backends()
    assert (result["rtol_outputs"], result["rtol_grads"]) == FLOAT32_RTOLS
    assert result["passed"] and result["metrics"]["passed"] and ad.check_metrics()["passed"], result[
        "failures"
    ]


def test_a_fault_in_pts_force_fold_is_named_backends_differ(
    adapter: DeepmdAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    def scaled(out, model_ret):  # type: ignore[no-untyped-def]
        out["energy_derv_r"] = out["energy_derv_r"] * 0.98  # the fault: pt's forces 2% short

    _edit_fold(monkeypatch, "deepmd.pt.model.model.make_model", scaled)
    fm = adapter.probe(configurations=["uncompiled"], checks=["backends", "physics"])
    result = fm.checks["backends"]
    assert not result["passed"]
    (f,) = [f for f in fm.findings if f.cause == "backends-differ"]
    assert f.severity == "error" and f.evidence["other"] == "pt" and f.evidence["reference"] == "pt_expt"
    assert set(f.evidence["outputs"]) == {"force"}  # energy and virial agree
    assert f.evidence["outputs"]["force"] == pytest.approx(0.02, rel=1e-6)
    assert "pt's force differs from pt_expt's by 0.02 of its scale" in f.message
    assert set(f.evidence["grads"]) == {"force"} and f.evidence["grads"]["force"] > 1e-3
    assert "pt_expt passes its own physics check" in f.message  # the reference's forces are -dE/dx
    # pt's rmse_f follows its forces: 2% off the documented definition from pt_expt's outputs, but pt's
    # loss reports it right for the forces pt computed.
    assert result["metrics"]["paths"]["pt"]["rmse_f"]["passed"]
    from gradprobe.claims import holds

    assert [c.kind for c in f.claims] == ["backend_output", "backend_grad", "check"]
    assert all(holds(fm, c) for c in f.claims)
    assert _errors_of(fm) == {"backends-differ"}, render(fm)
