"""SevenNet 0.13 probed through the generic potential adapter (issue 33): the user code of
``examples/sevennet_probe.py`` (at most ten lines), and what the issue's table records for it on
torch 2.13 — every term reaches every parameter in eager (SevenNet-0 too); the model compiled alone
fails every term with the leaf-in-place error of ``coerce_to_expected_memory_format`` at
``force_output.py:177``, and with that error patched away trains the energy exactly while forces and
stress need a double backward; ``make_fx`` stops on a data-dependent read at ``node_embedding.py:46``;
the physics check runs in float32 (SevenNet casts to float32 inside), states the force error it can
detect, passes, and fails (exit 1) on forces scaled by 0.98. Skips without sevenn."""

from __future__ import annotations

import pytest

pytest.importorskip("sevenn")

from examples_loader import load_example
from real_packages import errors, finding, torch_behaviour, user_lines

pytestmark = pytest.mark.real_packages

ex = load_example("sevennet_probe.py")
TINY = 14  # trainable tensors of the example's tiny model (two interaction layers)


@pytest.fixture(scope="module")
def system():  # type: ignore[no-untyped-def]
    return ex.tiny_model(), ex.tiny_batch(3.0), ex.loss_functions()


@pytest.fixture(scope="module")
def compiled(system):  # type: ignore[no-untyped-def]
    return ex.probe_sevennet(*system, "eager,compile_model:aot_eager,make_fx", ())


def test_the_user_code_is_at_most_ten_lines() -> None:
    assert user_lines(ex.probe_sevennet) <= 10


def test_eager_reaches_every_parameter_with_every_term(compiled) -> None:  # type: ignore[no-untyped-def]
    assert compiled.terms == ("energy", "force", "stress")
    for s in compiled.scenario_names:
        assert compiled.count("eager", s) == (TINY, TINY), s


def test_sevennet_0_reaches_every_parameter_with_every_term() -> None:
    fm = ex.probe_sevennet(ex.pretrained(), ex.tiny_batch(5.0), ex.loss_functions(), "eager", ())
    assert [fm.count("eager", s) for s in fm.scenario_names] == [(34, 34)] * 4 and fm.exit_code == 0


def test_the_model_compiled_alone_fails_every_term_at_force_output(compiled) -> None:  # type: ignore[no-untyped-def]
    v = "compile_model:aot_eager"
    messages = [
        (compiled.run(v, s).error.message if compiled.run(v, s).error else "")
        for s in compiled.scenario_names
    ]
    torch_behaviour(
        all("leaf Variable that requires grad is being used in an in-place operation" in m for m in messages),
        "the leaf-in-place error of coerce_to_expected_memory_format on every term of SevenNet compiled alone",
    )
    f = finding(compiled, "create-graph-tangent-strides")
    assert "force_output.py:177" in f.message and "coerce_to_expected_memory_format" in f.message
    assert f.location["file"].endswith("sevenn/nn/force_output.py") and f.location["line"] == 177


def test_make_fx_stops_on_a_data_dependent_read_in_the_embedding(compiled) -> None:  # type: ignore[no-untyped-def]
    f = finding(compiled, "data-dependent-trace")
    assert f.location["file"].endswith("sevenn/nn/node_embedding.py") and f.location["line"] == 46
    assert errors(compiled) == ["create-graph-tangent-strides", "data-dependent-trace"]


def test_with_the_torch_error_patched_away_energy_is_exact_and_forces_need_a_double_backward(
    system, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    import torch._dynamo  # noqa: F401  # runtime_wrappers imports dynamo: import it first
    from torch._functorch._aot_autograd import runtime_wrappers

    original = runtime_wrappers.coerce_to_expected_memory_format

    def restrided_off_the_leaf(x, memory_format):  # type: ignore[no-untyped-def]
        return original(x.detach(), memory_format).requires_grad_(x.requires_grad)

    monkeypatch.setattr(runtime_wrappers, "coerce_to_expected_memory_format", restrided_off_the_leaf)
    fm = ex.probe_sevennet(*system, "eager,compile_model:aot_eager", ())
    v = "compile_model:aot_eager"
    assert fm.run(v, "energy only").error is None and not fm.differences(v, "energy only")
    assert fm.count(v, "energy only") == fm.count("eager", "energy only")
    for s in ("force only", "stress only", "all"):
        assert "double backward" in fm.run(v, s).error.message
    assert errors(fm) == ["double-backward-unsupported"]


def test_physics_in_float32_states_what_it_detects_and_passes(system) -> None:  # type: ignore[no-untyped-def]
    fm = ex.probe_sevennet(*system, "eager", ("physics",))
    p = fm.checks["physics"]
    assert p["passed"] and fm.exit_code == 0, p["failures"]
    assert p["precision"]["dtype"] == "float32" and "float64 copy could not run" in p["precision"]["why"]
    assert "same dtype" in p["precision"]["why"]
    assert 0 < p["precision"]["detectable"] < 0.02  # a 2 % force error is within reach


def test_the_example_fails_on_forces_scaled_by_0_98(capsys: pytest.CaptureFixture[str]) -> None:
    assert ex.main(["--scale-forces", "0.98"]) == 1
    out = capsys.readouterr().out
    assert "ERROR forces-not-conservative" in out and "float32" in out
