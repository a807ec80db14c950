"""Bad input gets a clear error naming the term or parameter and what to do."""

import pytest
import torch
from torch import nn

import gradprobe
from gradprobe import SpecError, StepContractError


def lin():
    return nn.Linear(2, 1)


def test_non_scalar_term():
    with pytest.raises(
        StepContractError, match=r"term 'force' must be a scalar .*shape \(4, 1\).*\.mean\(\)"
    ):
        gradprobe.probe(lin(), lambda m, b: {"force": m(b)}, torch.ones(4, 2))


def test_non_tensor_term():
    with pytest.raises(StepContractError, match="term 'e' must be a torch.Tensor, got float"):
        gradprobe.probe(lin(), lambda m, b: {"e": 1.0}, torch.ones(4, 2))


def test_step_returns_total_in_terms_mode():
    with pytest.raises(StepContractError, match="must return a dict .*weights-mode step"):
        gradprobe.probe(lin(), lambda m, b: m(b).sum(), torch.ones(4, 2))


def test_step_returns_other_terms_than_declared():
    with pytest.raises(StepContractError, match=r"missing \['virial'\]; undeclared \['vir'\]"):
        gradprobe.probe(
            lin(), lambda m, b: {"energy": m(b).sum(), "vir": m(b).mean()}, torch.ones(4, 2),
            terms=["energy", "virial"],
        )  # fmt: skip


def test_weights_step_returns_dict():
    with pytest.raises(StepContractError, match="must return the total loss .*terms-mode step"):
        gradprobe.probe(lin(), lambda m, b, w: {"e": m(b).sum()}, torch.ones(4, 2), terms=["e"])


def test_unknown_term_in_weights():
    def step(m, b, w):
        return w["forces"] * m(b).sum()

    with pytest.raises(
        StepContractError, match=r"unknown term 'forces' \(did you mean 'force'\?\); terms are: energy, force"
    ):
        gradprobe.probe(lin(), step, torch.ones(4, 2), terms=["energy", "force"])


def test_unknown_term_in_scenarios():
    with pytest.raises(
        SpecError, match=r"scenario 'x' names unknown term 'enrgy' \(did you mean 'energy'\?\)"
    ):
        gradprobe.probe(
            lin(), lambda m, b: {"energy": m(b).sum()}, torch.ones(4, 2), scenarios={"x": ["enrgy"]}
        )


def test_weights_mode_needs_terms():
    with pytest.raises(SpecError, match="weights-mode step needs terms="):
        gradprobe.probe(lin(), lambda m, b, w: m(b).sum(), torch.ones(4, 2))


def test_model_without_trainable_parameters():
    frozen = lin().requires_grad_(False)
    with pytest.raises(
        SpecError, match=r"no trainable parameters \(2 parameters, none with requires_grad=True\)"
    ):
        gradprobe.probe(frozen, lambda m, b: {"e": m(b).sum()}, torch.ones(4, 2))
    with pytest.raises(SpecError, match="no trainable parameters"):
        gradprobe.probe(nn.ReLU(), lambda m, b: {"e": m(b).sum()}, torch.ones(4, 2))


def test_batch_on_another_device():
    # The meta device stands in for an accelerator on a CPU-only machine.
    batch = {"coord": torch.ones(4, 2, device="meta")}
    with pytest.raises(SpecError, match=r"batch\['coord'\] is on meta but the model's parameters are on cpu"):
        gradprobe.probe(lin(), lambda m, b: {"e": m(b["coord"]).sum()}, batch)


def test_ambiguous_signature_and_bad_mode():
    with pytest.raises(SpecError, match="takes \\*args"):
        gradprobe.probe(lin(), lambda *a: {}, torch.ones(1, 2))
    with pytest.raises(SpecError, match="mode must be"):
        gradprobe.probe(lin(), lambda m, b: {}, torch.ones(1, 2), mode="both")


def test_future_spec_version():
    with pytest.raises(SpecError, match="spec version 2.*upgrade gradprobe"):
        gradprobe.ProbeSpec(model=lin(), step=lambda m, b: {}, batch=None, version=2)


def test_unknown_variant():
    with pytest.raises(SpecError, match="unknown variant 'eagr' \\(did you mean 'eager'\\?\\)"):
        gradprobe.probe(lin(), lambda m, b: {"e": m(b).sum()}, torch.ones(1, 2), variants="eagr")


def test_step_error_before_terms_known():
    def boom(m, b):
        raise ValueError("bad batch")

    with pytest.raises(StepContractError, match="raised ValueError before its terms were known: bad batch"):
        gradprobe.probe(lin(), boom, torch.ones(1, 2))
    # With terms declared it is a recorded run failure instead.
    fm = gradprobe.probe(lin(), boom, torch.ones(1, 2), terms=["e"])
    err = fm.run("eager", "e only").error
    assert (err.stage, err.type, err.message) == ("forward", "ValueError", "bad batch")
    assert fm.exit_code == 1
