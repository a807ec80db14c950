"""torchmd-net 3.1 (TensorNet) probed through the generic potential adapter (issue 33): the user code
of ``examples/torchmdnet_probe.py`` (at most ten lines), and what the issue's table records for it on
torch 2.13 — in eager the energy reaches all 50 parameters and the force 49 (not the output bias, an
energy shift); the model compiled alone with aot_eager trains the energy exactly and needs a double
backward for the force at ``torchmdnet/models/model.py:628``; ``make_fx`` stops on a data-dependent read
at ``output_modules.py:63``; ``torch.compile(model, backend="eager")`` returns forces with no gradient
path, silently (their values are right): create-graph-detached at ``model.py:628``, the neighbour list's
custom ``autograd.Function`` traced by dynamo with its backward under grad mode off; the physics check passes and fails (exit 1) on forces scaled by
0.98. Skips without torchmd-net (its warp kernels compile on first use, about 25 s)."""

from __future__ import annotations

import pytest

import gradprobe

pytest.importorskip("torchmdnet")

from examples_loader import load_example
from real_packages import errors, finding, torch_behaviour, user_lines

pytestmark = pytest.mark.real_packages

ex = load_example("torchmdnet_probe.py")
BIAS = "output_model.output_network.layers.2.bias"


@pytest.fixture(scope="module")
def probed():  # type: ignore[no-untyped-def]
    return ex.probe_torchmdnet(
        ex.tiny_model(),
        ex.tiny_batch(),
        "eager,compile_model:aot_eager,compile_model:eager,make_fx",
        ("physics",),
    )


def test_the_user_code_is_at_most_ten_lines() -> None:
    assert user_lines(ex.probe_torchmdnet) <= 10


def test_eager_energy_reaches_50_of_50_and_force_49_without_the_output_bias(probed) -> None:  # type: ignore[no-untyped-def]
    assert probed.count("eager", "energy only") == (50, 50) and probed.count("eager", "force only") == (
        49,
        50,
    )
    assert set(probed.trainable) - probed.reached("eager", "force only") == {BIAS}


def test_compiled_alone_with_aot_eager_trains_energy_and_names_the_double_backward(probed) -> None:  # type: ignore[no-untyped-def]
    v = "compile_model:aot_eager"
    assert probed.run(v, "energy only").error is None and not probed.differences(v, "energy only")
    torch_behaviour(
        all("double backward" in probed.run(v, s).error.message for s in ("force only", "all")),
        "AOTAutograd refusing the double backward of torchmd-net's forces",
    )
    f = finding(probed, "double-backward-unsupported")
    assert f.location["file"].endswith("torchmdnet/models/model.py") and f.location["line"] == 628


def test_make_fx_stops_on_a_data_dependent_read_in_the_output_module(probed) -> None:  # type: ignore[no-untyped-def]
    f = finding(probed, "data-dependent-trace")
    assert f.location["file"].endswith("torchmdnet/models/output_modules.py") and f.location["line"] == 63


def test_the_eager_backend_returns_forces_with_no_gradient_path(probed) -> None:  # type: ignore[no-untyped-def]
    v = "compile_model:eager"
    force = probed.run(v, "force only")
    torch_behaviour(
        force.error is not None and force.error.type == "NoGradPath",
        "torch.compile(backend='eager') returning torchmd-net's forces with no gradient path",
    )
    # Silent: nothing raised; the forces' values are right (the path's own physics passes), only their
    # gradient is gone, and with it every force gradient of the 'all' scenario.
    assert probed.checks["physics_paths"][v]["passed"]
    assert probed.run(v, "energy only").error is None and not probed.differences(v, "energy only")
    assert len(probed.differences(v, "all")) >= 40
    # Named create-graph-detached (below), which explains those runs: no generic finding repeats them.
    assert "create-graph-detached" in errors(probed)
    assert not {"run-failed", "flow-mismatch"} & set(errors(probed))


def test_no_finding_guesses_eval_mode_or_advises_the_refuted_eager_backend(probed) -> None:  # type: ignore[no-untyped-def]
    # Issue 32's false statements 1 and 3, on the package: the model is in train mode, and the eager
    # backend was just measured dropping every force gradient, so it is never advice for the double backward.
    text = " ".join(f"{f.message} {f.fix}" for f in probed.findings)
    assert "eval mode" not in text, text
    fix = finding(probed, "double-backward-unsupported").fix
    suggests = any(s in fix for s in ("backend='eager'", 'backend="eager"', "compile_model:eager"))
    assert not suggests or "refuted" in fix, fix
    assert gradprobe.claims.audit(probed) == []


def test_the_eager_backend_loss_is_named_a_lost_gradient_with_the_packages_line(probed) -> None:  # type: ignore[no-untyped-def]
    named = [f for f in probed.findings if f.evidence.get("variant") == "compile_model:eager" and f.location
             and str(f.location.get("file", "")).endswith("torchmdnet/models/model.py")]  # fmt: skip
    assert named and named[0].location["line"] == 628
    f = finding(probed, "create-graph-detached")
    assert f is named[0] and f.severity == "error"
    # Why, measured: the graph behind the call passes through the neighbour list's custom autograd.Function,
    # traced by dynamo with its backward under grad mode off; eager's same call returns a graph.
    (traced,) = f.evidence["traced_functions"]
    assert traced["applied_at"]["file"].endswith("torchmdnet/extensions/warp_ops/neighbors.py")
    assert "in eager the same call returns them with a graph" in f.message and "(not tried)" in f.fix


def test_physics_passes_and_the_example_fails_on_forces_scaled_by_0_98(probed, capsys) -> None:  # type: ignore[no-untyped-def]
    p = probed.checks["physics"]
    assert p["passed"] and p["precision"]["dtype"] == "float64", p["failures"]
    assert ex.main(["--scale-forces", "0.98"]) == 1
    assert "ERROR forces-not-conservative" in capsys.readouterr().out
