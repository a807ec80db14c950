"""TorchANI 2.9 probed as its users run it (issue 16): with the model compiled (aot_eager) and forces
from ``torchani.grad.forces_for_training``, torch 2.13 fails on a create_graph gradient with unexpected
strides; when the model's backward was first run plain (an energy-only pass), it fails earlier on
donated buffers, and turning donation off exposes the strides failure: each is named, with TorchANI's
own line. make_fx fails on a data-dependent ``.any()`` in TorchANI. Skips without torchani."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchani")

from donation import donation

import gradprobe
from gradprobe.variants import user_variant

pytestmark = pytest.mark.real_packages


def _model() -> torch.nn.Module:
    from torchani.arch import simple_ani

    torch.manual_seed(0)
    # ANI-2x-like architecture, no built-in self energies or repulsion constants: nothing is downloaded.
    return simple_ani(["H", "C", "O"], "wb97x-631gd", repulsion=False, self_energies="zero").double()


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"species": torch.tensor([[6, 1, 1, 8, 1]]),
            "coordinates": torch.rand(1, 5, 3, generator=g, dtype=torch.float64) * 2.0,
            "energies": torch.randn(1, generator=g, dtype=torch.float64),
            "forces": torch.randn(1, 5, 3, generator=g, dtype=torch.float64)}  # fmt: skip


def _terms(model, batch):  # type: ignore[no-untyped-def]
    from torchani.grad import forces_for_training

    coords = batch["coordinates"].clone().requires_grad_(True)
    energies = model((batch["species"], coords)).energies
    forces = forces_for_training(energies, coords)
    return {"energy": (energies - batch["energies"]).pow(2).mean(),
            "force": (forces - batch["forces"]).pow(2).mean()}  # fmt: skip


def _errors(fm: gradprobe.FlowMap) -> list[str]:
    return sorted({f.cause for f in fm.findings if f.severity == "error"})


def test_the_compiled_model_fails_on_create_graph_tangent_strides_at_torchanis_line() -> None:
    fm = gradprobe.probe(_model(), _terms, _batch(), variants="eager,compile_model:aot_eager,make_fx",
                         progress=False)  # fmt: skip
    (f,) = [f for f in fm.findings if f.cause == "create-graph-tangent-strides"]
    assert {tuple(r) for r in f.evidence["runs"]} == {
        ("compile_model:aot_eager", s) for s in fm.scenario_names
    }
    assert "site-packages/torchani/" in f.location["file"] and "autograd.grad" in f.location["code"]
    assert any("coerce_to_expected_memory_format" in fr for fr in f.evidence["error"].frames)
    (dd,) = [f for f in fm.findings if f.cause == "data-dependent-trace"]
    assert "site-packages/torchani/" in dd.location["file"] and ".any()" in dd.location["code"]
    assert _errors(fm) == ["create-graph-tangent-strides", "data-dependent-trace"]


def _trained_on_energy_first(ctx):  # type: ignore[no-untyped-def]
    """The model compiled (aot_eager) and first run with a plain backward (an energy-only pass): its
    backward is compiled with donated buffers. ``donated_buffer`` (the knob) is set around the compile
    and every run, aot_eager only, and restored."""
    on = ctx.knobs.get("donated_buffer", True)
    with donation(on):
        compiled = torch.compile(ctx.model, backend="aot_eager")
        coords = ctx.batch["coordinates"].clone().requires_grad_(True)
        energies = compiled((ctx.batch["species"], coords)).energies
        torch.autograd.grad(energies.sum(), [p for p in ctx.model.parameters() if p.requires_grad])

    def run(batch, weights):  # type: ignore[no-untyped-def]
        with donation(on):
            terms = _terms(compiled, batch)
        return weights["energy"] * terms["energy"] + weights["force"] * terms["force"], terms

    return run


def test_donated_buffers_then_what_turning_donation_off_exposes() -> None:
    knobs = {"donated_buffer": (True, (True, False))}
    variants = ["eager", user_variant("ani", _trained_on_energy_first, knobs),
                user_variant("ani", _trained_on_energy_first, knobs, donated_buffer=False)]  # fmt: skip
    fm = gradprobe.probe(_model(), _terms, _batch(), variants=variants, progress=False)
    (d,) = [f for f in fm.findings if f.cause == "donated-buffers"]
    assert d.evidence["variant"] == "ani" and "site-packages/torchani/" in d.location["file"]
    assert "ani[donated_buffer=false]" in d.evidence["next"]
    assert "create-graph-tangent-strides" in d.evidence["next"]
    (s,) = [f for f in fm.findings if f.cause == "create-graph-tangent-strides"]
    assert s.evidence["variant"] == "ani[donated_buffer=false]"
    assert _errors(fm) == ["create-graph-tangent-strides", "donated-buffers"]
    import torch._functorch.config as functorch_config

    assert functorch_config.donated_buffer is True
