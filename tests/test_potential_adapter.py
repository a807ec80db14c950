"""The generic potential adapter and the checks that run on any model (issue 33, items 1-2), on a tiny
graph potential written like the MLIP packages' (``potential_models.py``): graph batches with no
reshaping, the physics check in a float32-only model's own precision (its detectable error stated, a
2 % force error still caught), models caching computed tensors or holding what cannot be copied, and
the package's own loss split into terms."""

from __future__ import annotations

import threading

import pytest
import torch
from potential_models import Graph, graph_batch, tiny

import gradprobe
from gradprobe.adapters.potential import PotentialAdapter, Stress, with_forces_scaled
from gradprobe.geometry import edge_vectors

LABELS = {"energy": "energy_label", "force": "force_label", "stress": "stress_label"}


def _adapter(model: torch.nn.Module, batch: object, **kw: object) -> PotentialAdapter:
    return PotentialAdapter(model, batch, stress="stress", **{"labels": LABELS, **kw})  # type: ignore[arg-type]


def _errors(fm: gradprobe.FlowMap) -> list[str]:
    return sorted({f.cause for f in fm.findings if f.severity == "error"})


@pytest.mark.parametrize("as_dict", [False, True])
def test_a_graph_batch_passes_physics_in_float64_and_scaled_forces_fail(as_dict: bool) -> None:
    model, batch = tiny(), graph_batch(as_dict=as_dict)
    adapter = _adapter(model, batch)
    assert adapter.geometry.positions == "pos" and adapter.geometry.cell == "cell"
    fm = adapter.probe(checks=["physics"])
    p = fm.checks["physics"]
    assert p["passed"] and fm.exit_code == 0, p["failures"]
    assert p["precision"] == {"dtype": "float64", "on": "a float64 copy"}
    assert p["force"]["max_rel_error"] < 1e-6 and p["virial"]["max_rel_error"] < 1e-6
    assert fm.count("eager", "force only")[0] == fm.count("eager", "force only")[1]
    handle = with_forces_scaled(model, 0.98, "forces")
    fm = adapter.probe(checks=["physics"])
    handle.remove()
    assert _errors(fm) == ["forces-not-conservative"] and fm.exit_code == 1
    assert "differ from -dE/dx" in fm.checks["physics"]["failures"][0]


def test_edge_vectors_computed_with_the_batch_are_rebuilt_for_each_move() -> None:
    model, batch = tiny(precomputed_edges=True), graph_batch()
    fm = _adapter(model, batch).probe(checks=["physics"])
    (failure, *_) = fm.checks["physics"]["failures"]
    assert "does not change when the positions move" in failure and "rebuild" in failure  # says why
    fm = _adapter(model, batch, rebuild=edge_vectors("edge_vec", shift="shift")).probe(checks=["physics"])
    assert fm.checks["physics"]["passed"] and fm.exit_code == 0, fm.checks["physics"]["failures"]


def test_a_float32_only_model_is_checked_in_float32_and_a_two_percent_error_is_caught() -> None:
    model, batch = tiny(float32_inside=True), graph_batch(dtype=torch.float32)
    adapter = _adapter(model, batch, rebuild=None)
    fm = adapter.probe(checks=["physics", "training", "balance"])
    p = fm.checks["physics"]
    assert p["passed"] and _errors(fm) == [] and fm.exit_code == 0, p["failures"]
    precision = p["precision"]
    assert precision["dtype"] == "float32" and precision["on"] == "a copy"
    # The float64 copy's failure is said, with the frame it came from.
    assert "float64 copy could not run" in precision["why"] and "same dtype" in precision["why"]
    assert "potential_models.py:" in precision["why"]
    assert 0 < precision["detectable"] < 0.02  # the error this check catches is stated, and below 2 %
    text = gradprobe.render(fm)
    assert "float32" in text and "detects forces off by" in text and "could not run" in text
    assert fm.checks["training"]["verdicts"]["eager"] == dict.fromkeys(
        ("energy", "force", "stress"), "decreases"
    )
    handle = with_forces_scaled(model, 0.98, "forces")
    fm = adapter.probe(checks=["physics"])
    handle.remove()
    assert _errors(fm) == ["forces-not-conservative"] and fm.exit_code == 1


@pytest.mark.parametrize("kind", ["float32 only", "caching"])
def test_training_and_balance_run_and_fail_on_an_injected_fault(kind: str) -> None:
    dtype = torch.float32 if kind == "float32 only" else torch.float64
    switches = {"float32_inside": True} if kind == "float32 only" else {"cache": True}
    batch = graph_batch(dtype=dtype)
    healthy = tiny(dtype, **switches)
    healthy(batch)  # a forward first: a caching model then holds tensors with a grad_fn
    asgd = lambda params: torch.optim.ASGD(params, lr=1e-3)  # noqa: E731  # stepped on a model copy
    fm = _adapter(healthy, batch).probe(checks=["physics", "training", "balance"], optimizer=asgd)
    assert _errors(fm) == [] and fm.exit_code == 0, [f.message for f in fm.findings]
    assert fm.checks["training"]["on"] == "a copy" and "effective_update" in fm.checks["balance"]
    # The training check's fault: forces without create_graph train nothing.
    fm = _adapter(tiny(dtype, detach_forces=True, **switches), batch).probe(checks=["training"])
    assert fm.checks["training"]["verdicts"]["eager"]["force"] == "error" and fm.exit_code == 1
    # The balance check's fault: a parameter group the optimizer never moves (lr 0).
    frozen = lambda params: torch.optim.ASGD([{"params": params[:2], "lr": 0.0}, {"params": params[2:]}])  # noqa: E731
    fm = _adapter(healthy, batch).probe(checks=["balance"], optimizer=frozen)
    assert "zero-learning-rate" in _errors(fm) and fm.exit_code == 1


def test_a_model_holding_what_cannot_be_copied_is_checked_on_itself() -> None:
    model, batch = tiny(cache=True), graph_batch()
    model.lock = threading.Lock()  # type: ignore[attr-defined]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fm = _adapter(model, batch).probe(checks=["physics", "training", "balance"],
                                      optimizer=lambda params: torch.optim.ASGD(params, lr=1e-3))  # fmt: skip
    assert _errors(fm) == [] and fm.exit_code == 0, [f.message for f in fm.findings]
    assert fm.checks["physics"]["precision"]["on"] == "the model itself"
    for why in (fm.checks["physics"]["precision"]["why"], fm.checks["training"]["why"],
                fm.checks["balance"]["effective_update"]["why"]):  # fmt: skip
        assert "attribute 'lock' of the root module (PairPotential)" in why
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    handle = with_forces_scaled(model, 0.98, "forces")
    fm = _adapter(model, batch).probe(checks=["physics"])
    handle.remove()
    assert _errors(fm) == ["forces-not-conservative"] and fm.exit_code == 1


def test_a_copy_names_the_attribute_that_refuses_it() -> None:
    from gradprobe.copies import CopyError, model_copy

    model = tiny(cache=True)
    model(graph_batch())
    copied = model_copy(model)  # feature_dict's computed tensors are copied detached
    assert copied.feature_dict["edges"].grad_fn is None and model.feature_dict["edges"].grad_fn is not None
    model.pool = {"lock": threading.Lock()}  # type: ignore[attr-defined]
    with pytest.raises(
        CopyError, match="attribute 'pool' of the root module \\(PairPotential\\) holds a dict"
    ):
        model_copy(model)


def test_forces_by_autograd_outside_the_model() -> None:
    model, batch = tiny(own_forces=False), graph_batch()
    adapter = PotentialAdapter(
        model, batch, forces=None, labels={"energy": "energy_label", "force": "force_label"}
    )
    assert adapter.terms == ("energy", "force") and "autograd outside" in adapter.describe()
    fm = adapter.probe(checks=["physics"])
    assert fm.checks["physics"]["passed"] and fm.exit_code == 0
    assert fm.count("eager", "force only")[0] > 0


def test_the_packages_own_loss_returning_only_its_total_is_split_into_terms() -> None:
    model, batch = tiny(), graph_batch()
    prefactors = {"energy": 1.0, "force": 10.0, "stress": 0.1}

    def total(out: dict, b: Graph) -> torch.Tensor:  # a package's loss: one number
        loss = prefactors["energy"] * (out["energy"] - b.energy_label).pow(2).mean()
        loss = loss + prefactors["force"] * (out["forces"] - b.force_label).pow(2).mean()
        return loss + prefactors["stress"] * (out["stress"] - b.stress_label).pow(2).mean()

    own = _adapter(model, batch, loss=total)
    standard = _adapter(model, batch, weights=prefactors, energy_loss="per_frame")
    mine, theirs = own.terms_of(model, batch), standard.terms_of(model, batch)
    assert set(mine) == {"energy", "force", "stress"}
    for t in mine:
        torch.testing.assert_close(mine[t], theirs[t])
    # What no output explains (a regulariser) is its own term.
    reg = _adapter(model, batch, loss=lambda out, b: total(out, b) + model.radial.weight.pow(2).sum())
    assert set(reg.terms_of(model, batch)) == {"energy", "force", "stress", "other"}
    fm = own.probe()
    assert fm.terms == ("energy", "force", "stress") and fm.exit_code == 0


def test_stress_conventions_are_declared_and_a_wrong_sign_is_said() -> None:
    model, batch = tiny(), graph_batch()
    voigt = lambda out: -out["stress"][:, [0, 1, 2, 0, 1, 2], [0, 1, 2, 1, 2, 0]]  # noqa: E731  # SevenNet's
    adapter = PotentialAdapter(model, batch, stress=Stress(voigt, scale=-1, order="xx yy zz xy yz zx"))
    assert adapter.probe(checks=["physics"]).checks["physics"]["passed"]
    wrong = PotentialAdapter(model, batch, stress=Stress("stress", scale=-1))
    p = wrong.probe(checks=["physics"]).checks["physics"]
    assert not p["passed"] and "opposite sign" in p["failures"][-1]


def test_describe_states_the_normalisation() -> None:
    adapter = _adapter(tiny(), graph_batch())
    text = adapter.describe()
    assert "energy MSE of the energy per atom" in text and "force MSE over atoms and components" in text
    assert "label at 'force_label'" in text and "cells at 'cell'" in text
    per_frame = _adapter(tiny(), graph_batch(), energy_loss="per_frame", labels={})
    assert "per frame" in per_frame.describe() and "zeros (no label given)" in per_frame.describe()


def test_bad_input_is_named() -> None:
    batch = graph_batch()
    with pytest.raises(gradprobe.SpecError, match="no positions at 'R'.*the batch has: pos, batch"):
        PotentialAdapter(tiny(), batch, positions="R")
    with pytest.raises(gradprobe.SpecError, match="unknown term 'forces'"):
        PotentialAdapter(tiny(), batch, labels={"forces": "force_label"})
    with pytest.raises(gradprobe.SpecError, match="no stress output"):
        PotentialAdapter(tiny(), batch, terms=["stress"])
