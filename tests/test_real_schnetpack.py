"""SchNetPack 2.1 probed as its users run it (issue 16): the model compiled alone trains the energy and
names the double backward of forces and stress; make_fx names SchNetPack's own line
(``int(idx_m[-1])``). SchNetPack has no compile path of its own to compare. Skips without schnetpack."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator

import pytest
import torch

if importlib.util.find_spec("schnetpack") is None:
    pytest.skip("schnetpack is not installed", allow_module_level=True)

# torch 2.13 renamed torch.utils.data.dataloader.T_co to _T_co; SchNetPack 2.1 still imports the old
# name. Give it the alias here (the test's workaround; the package is not patched).
import torch.utils.data.dataloader as _dataloader

if not hasattr(_dataloader, "T_co"):
    _dataloader.T_co = _dataloader._T_co  # type: ignore[attr-defined]

spk = pytest.importorskip("schnetpack")

import gradprobe  # noqa: E402

pytestmark = pytest.mark.real_packages


# The tiny SchNet potential, its frame and its step (tests/schnetpack_model.py).
import schnetpack_model  # noqa: E402

_system, _step = schnetpack_model._system, schnetpack_model.schnetpack_step


def _model() -> torch.nn.Module:
    return schnetpack_model._model(spk)


def test_the_model_compiled_alone_trains_energy_and_names_the_double_backward() -> None:
    fm = gradprobe.probe(_model(), _step, _system(), variants="eager,compile_model:aot_eager,make_fx",
                         progress=False)  # fmt: skip
    v = "compile_model:aot_eager"
    assert fm.run(v, "energy only").error is None and not fm.differences(v, "energy only")
    assert fm.count(v, "energy only") == fm.count("eager", "energy only")
    for s in ("force only", "stress only", "all"):
        assert "double backward" in fm.run(v, s).error.message
    (db,) = [f for f in fm.findings if f.cause == "double-backward-unsupported"]
    assert "energy only runs compiled" in db.message
    # The create_graph call in the package's own code (anomaly mode's trace of the failing node).
    assert "site-packages/schnetpack/" in db.location["file"] and "grad(" in db.location["code"]
    (dd,) = [f for f in fm.findings if f.cause == "data-dependent-trace"]
    assert "site-packages/schnetpack/" in dd.location["file"] and "idx_m" in dd.location["code"]
    errors = sorted({f.cause for f in fm.findings if f.severity == "error"})
    assert errors == ["data-dependent-trace", "double-backward-unsupported"]


def test_the_whole_step_compiled_is_not_separable() -> None:
    # The loss and forces inside the compiled region: on this torch even energy only raises.
    fm = gradprobe.probe(_model(), _step, _system(), variants="eager,compile:aot_eager", progress=False)
    assert all("double backward" in fm.run("compile:aot_eager", s).error.message for s in fm.scenario_names)
    (db,) = [f for f in fm.findings if f.cause == "double-backward-unsupported"]
    assert "not separable in this path" in db.message


@contextlib.contextmanager
def _settings(donated_buffer: bool) -> Iterator[None]:
    """dynamo's capture_scalar_outputs on (what NequIP's set_global_state sets process-wide, and what
    users set to keep ``int(idx_m[-1])`` in the graph), and AOTAutograd's donated_buffer, restored after."""
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config

    saved = dynamo_config.capture_scalar_outputs, functorch_config.donated_buffer
    dynamo_config.capture_scalar_outputs, functorch_config.donated_buffer = True, donated_buffer
    try:
        yield
    finally:
        dynamo_config.capture_scalar_outputs, functorch_config.donated_buffer = saved


def _compiled_capturing_scalars(ctx):  # type: ignore[no-untyped-def]
    """``torch.compile(model, backend="aot_eager")`` with scalar outputs captured (aot_eager only)."""
    on = ctx.knobs.get("donated_buffer", True)
    with _settings(on):
        compiled = torch.compile(ctx.model, backend="aot_eager")

    def run(batch, weights):  # type: ignore[no-untyped-def]
        with _settings(on):
            terms = _step(compiled, batch)
        return sum(weights[t] * terms[t] for t in terms), terms

    return run


def test_capturing_scalar_outputs_turns_it_into_donated_buffers_named_with_what_follows() -> None:
    from gradprobe.variants import user_variant

    knobs = {"donated_buffer": (True, (True, False))}
    variants = ["eager", user_variant("scalars", _compiled_capturing_scalars, knobs),
                user_variant("scalars", _compiled_capturing_scalars, knobs, donated_buffer=False)]  # fmt: skip
    fm = gradprobe.probe(_model(), _step, _system(), variants=variants, progress=False)
    (d,) = [f for f in fm.findings if f.cause == "donated-buffers"]
    assert {tuple(r) for r in d.evidence["runs"]} == {("scalars", s) for s in fm.scenario_names}
    assert "site-packages/schnetpack/" in d.location["file"]
    assert "scalars[donated_buffer=false]" in d.evidence["next"]
    # Donation off (measured): energy trains compiled and matches eager; forces hit the double backward.
    assert "double-backward-unsupported" in d.evidence["next"]
    off = "scalars[donated_buffer=false]"
    assert fm.run(off, "energy only").error is None and not fm.differences(off, "energy only")
    assert sorted({f.cause for f in fm.findings if f.severity == "error"}) == [
        "donated-buffers", "double-backward-unsupported",
    ]  # fmt: skip


def test_the_built_in_donation_knob_measures_what_turning_donation_off_exposes() -> None:
    # The same, with gradprobe's own variants: compile_model:aot_eager[donated_buffer=false] sets
    # torch._functorch.config.donated_buffer=False for its build and runs only.
    import torch._dynamo.config as dynamo_config

    from gradprobe.state import isolated_settings

    with isolated_settings():
        dynamo_config.capture_scalar_outputs = True
        fm = gradprobe.probe(_model(), _step, _system(), progress=False,
                             variants="eager,compile_model:aot_eager,compile_model:aot_eager[donated_buffer=false]")  # fmt: skip
    (d,) = [f for f in fm.findings if f.cause == "donated-buffers"]
    assert d.evidence["variant"] == "compile_model:aot_eager"
    assert "compile_model:aot_eager[donated_buffer=false]" in d.evidence["next"]
    assert "double-backward-unsupported" in d.evidence["next"]
    off = "compile_model:aot_eager[donated_buffer=false]"
    assert fm.run(off, "energy only").error is None and not fm.differences(off, "energy only")
    import torch._functorch.config as functorch_config

    assert functorch_config.donated_buffer is True
