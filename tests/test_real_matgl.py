"""matgl 4.1 (TensorNet in ``Potential``, PyG backend) probed through the generic potential adapter
(issue 33): the user code of ``examples/matgl_probe.py`` (at most ten lines), its loss that returns only
the total split into terms, and what the issue's table records for it on torch 2.13 — every term
reaches every parameter in eager; the model compiled alone with aot_eager trains the energy and needs a
double backward for forces and stress at ``pes.py:342``; with ``dynamic=True`` every term meets donated
buffers; ``make_fx`` puts a detach on a sigmoid gate's output (``_core.py:149``), named
``makefx-detach`` with the gate parameters it gets wrong; matgl's own ``Potential(compile_model=True)``
trains the energy, not the forces. TensorNet keeps computed tensors in ``model.feature_dict``: the
physics and training checks copy it anyway. The physics check passes and fails (exit 1) on forces
scaled by 0.98. Skips without matgl."""

from __future__ import annotations

import pytest

pytest.importorskip("matgl")

from examples_loader import load_example
from real_packages import errors, finding, torch_behaviour, user_lines

pytestmark = pytest.mark.real_packages

ex = load_example("matgl_probe.py")
TINY = 58  # trainable tensors of the example's tiny TensorNet (two blocks)


@pytest.fixture(scope="module")
def system():  # type: ignore[no-untyped-def]
    return ex.tiny_module(), ex.tiny_batch()


@pytest.fixture(scope="module")
def compiled(system):  # type: ignore[no-untyped-def]
    return ex.probe_matgl(*system, "eager,compile_model:aot_eager,compile_model:aot_eager[dynamic=true]", ())


def test_the_user_code_is_at_most_ten_lines() -> None:
    assert user_lines(ex.probe_matgl) <= 10


def test_the_total_only_loss_is_split_into_terms_that_sum_to_it(system) -> None:  # type: ignore[no-untyped-def]
    import torch

    from gradprobe.adapters.potential import PotentialAdapter

    lit, batch = system
    total = lambda out, b: lit.loss_fn(lit.loss, b[3:], out[:3], b[0].ptr.diff())["Total_Loss"]  # noqa: E731
    adapter = PotentialAdapter(lit.model, batch, call=lambda m, b: m(*b[:3]), energy=0, forces=1, stress=2,
                               positions="0.frac_coords", fractional=True, cell=1,
                               labels={"energy": 3, "force": 4, "stress": 5}, loss=total)  # fmt: skip
    terms = adapter.terms_of(lit.model, batch)
    assert set(terms) == {"energy", "force", "stress"}  # nothing left over: no "other"
    outputs = lit.model(*batch[:3])
    torch.testing.assert_close(sum(terms.values()), total(outputs, batch))
    assert all(float(v) > 0 for v in terms.values())


def test_eager_reaches_every_parameter_with_every_term(compiled) -> None:  # type: ignore[no-untyped-def]
    assert [compiled.count("eager", s) for s in compiled.scenario_names] == [(TINY, TINY)] * 4


def test_compiled_alone_trains_energy_and_names_the_double_backward(compiled) -> None:  # type: ignore[no-untyped-def]
    v = "compile_model:aot_eager"
    assert compiled.run(v, "energy only").error is None and not compiled.differences(v, "energy only")
    torch_behaviour(
        all(
            "double backward" in compiled.run(v, s).error.message
            for s in ("force only", "stress only", "all")
        ),
        "AOTAutograd refusing the double backward of matgl's forces and stress",
    )
    f = finding(compiled, "double-backward-unsupported")
    assert f.location["file"].endswith("matgl/apps/pes.py") and f.location["line"] == 342


def test_dynamic_shapes_meet_donated_buffers_on_every_term(compiled) -> None:  # type: ignore[no-untyped-def]
    v = "compile_model:aot_eager[dynamic=true]"
    torch_behaviour(
        all("donated buffers" in compiled.run(v, s).error.message for s in compiled.scenario_names),
        "donated buffers on every term of matgl compiled with dynamic=True",
    )
    assert "donated-buffers" in errors(compiled)


def test_make_fx_detaches_a_sigmoid_gate_and_gets_gate_gradients_wrong(system) -> None:  # type: ignore[no-untyped-def]
    fm = ex.probe_matgl(*system, "eager,make_fx", (), diagnose=True)
    f = finding(fm, "makefx-detach")
    torch_behaviour(bool(fm.differences("make_fx", "force only")), "make_fx's detach on matgl's sigmoid gate")
    wrong = fm.differences("make_fx", "force only")
    assert len(wrong) >= 5 and all(".gates." in p for p in wrong)
    assert max(c.rel_error for c in wrong.values()) < 0.1  # a few percent: counts alone would miss it
    assert "sigmoid" in f.message and "_core.py:149" in f.message
    assert fm.count("make_fx", "force only") == (TINY, TINY)


def test_feature_dict_does_not_stop_the_checks_and_physics_passes(system) -> None:  # type: ignore[no-untyped-def]
    lit, batch = system
    lit.model(*batch[:3])  # TensorNet's feature_dict now holds tensors with a grad_fn
    held = lit.model.model.feature_dict
    assert any(getattr(v, "grad_fn", None) is not None for v in held.values())
    fm = ex.probe_matgl(lit, batch, "eager", ("physics", "training"))
    assert errors(fm) == [] and fm.exit_code == 0, [f.message for f in fm.findings]
    assert fm.checks["physics"]["passed"] and fm.checks["physics"]["precision"]["on"] == "a float64 copy"
    assert fm.checks["training"]["on"] == "a copy"
    assert set(fm.checks["training"]["verdicts"]["eager"].values()) == {"decreases"}


def test_the_example_fails_on_forces_scaled_by_0_98(capsys: pytest.CaptureFixture[str]) -> None:
    assert ex.main(["--scale-forces", "0.98"]) == 1
    assert "ERROR forces-not-conservative" in capsys.readouterr().out


@pytest.mark.inductor
def test_matgls_own_compile_model_trains_energy_not_forces(system, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import torch._functorch.config as functorch_config
    from matgl.apps.pes import Potential

    # Potential(compile_model=True) sets donated_buffer = False process-wide: given back after the test.
    monkeypatch.setattr(functorch_config, "donated_buffer", functorch_config.donated_buffer)

    lit, batch = system
    net = lit.model.model
    own = type(lit)(model=net, stress_weight=0.1)  # matgl's module, its Potential compiled by matgl
    own.model = Potential(model=net, calc_stresses=True, compile_model=True).train()
    fm = ex.probe_matgl(own, batch, "eager", ())
    assert fm.run("eager", "energy only").error is None and fm.count("eager", "energy only") == (TINY, TINY)
    torch_behaviour(
        all(fm.run("eager", s).error is not None for s in ("force only", "stress only", "all")),
        "matgl's Potential(compile_model=True) failing on forces",
    )
    assert any("double backward" in fm.run("eager", s).error.message for s in ("force only", "all"))
