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

    with pytest.raises(
        StepContractError,
        match=r"raised ValueError at test_bad_input.py:\d+ \(raise .*\) before its terms were known: bad",
    ):
        gradprobe.probe(lin(), boom, torch.ones(1, 2))
    # With terms declared it is a recorded run failure instead.
    fm = gradprobe.probe(lin(), boom, torch.ones(1, 2), terms=["e"])
    err = fm.run("eager", "e only").error
    assert (err.stage, err.type, err.message) == ("forward", "ValueError", "bad batch")
    assert fm.exit_code == 1


def _fit(m, b):
    return {"e": m(b).sum()}


def test_a_model_on_the_meta_device():
    with pytest.raises(SpecError, match=r"meta device.*to_empty"):
        gradprobe.probe(nn.Linear(2, 1, device="meta"), _fit, torch.ones(4, 2))


def test_an_uninitialised_lazy_module():
    with pytest.raises(SpecError, match=r"uninitialized.*LazyLinear.*one forward"):
        gradprobe.probe(nn.Sequential(nn.LazyLinear(1)), _fit, torch.ones(4, 2))


def test_a_model_class_instead_of_an_instance():
    with pytest.raises(SpecError, match=r"model is the class Linear.*Linear\(\.\.\.\).*TypeError"):
        gradprobe.probe(nn.Linear, _fit, torch.ones(4, 2))


def test_a_model_factory_that_raises():
    def factory():
        raise OSError("checkpoint.pt not found")

    with pytest.raises(SpecError, match=r"the model factory raised OSError: checkpoint.pt not found"):
        gradprobe.probe(factory, _fit, torch.ones(4, 2))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("seed", 2**70, r"seed must be an integer from 0 to 2\*\*64 - 1, got 1180591620717411303424"),
        ("seed", 1.5, r"seed must be an integer .*got 1.5"),
        ("seed", True, r"seed must be an integer"),
        ("notes", ["aux_head"], r"notes must be a mapping .*\{'aux_head': 'why'\}"),
        ("clip_grad_norm", "1.0", r"clip_grad_norm must be a positive number .*got the string '1.0'"),
        ("clip_grad_norm", -1.0, r"clip_grad_norm must be a positive number"),
        ("optimizer", "adam", r"optimizer must be .*got the string 'adam'.*torch.optim.Adam\(params"),
        (
            "differentiable_inputs",
            "coord",
            r"differentiable_inputs must be a list of batch keys.*\['coord'\]",
        ),
    ],
)
def test_spec_fields_of_the_wrong_type(field, value, message):
    with pytest.raises(SpecError, match=message):
        gradprobe.ProbeSpec(model=lin(), step=_fit, batch=torch.ones(4, 2), **{field: value})


def test_checks_as_a_string():
    with pytest.raises(
        SpecError, match=r"checks must be a list of names, got the string 'physics'.*\['physics'\]"
    ):
        gradprobe.probe(lin(), _fit, torch.ones(4, 2), checks="physics")


def test_the_edges_of_the_seed_range_are_accepted():
    for seed in (0, 2**64 - 1):
        fm = gradprobe.probe(lin(), _fit, torch.ones(4, 2), seed=seed)
        assert fm.count("eager", "e only") == (2, 2)


def test_a_probe_inside_inference_mode_leaves_it_and_measures():
    # enable_grad does not leave inference mode: without leaving it, nothing would be reached.
    model, x = lin(), torch.ones(4, 2)
    with torch.inference_mode():
        fm = gradprobe.probe(model, _fit, x, checks=["training"])
        assert torch.is_inference_mode_enabled()  # the caller's mode, as found
    assert fm.count("eager", "e only") == (2, 2) and fm.exit_code == 0
    assert fm.checks["training"]["verdicts"]["eager"] == {"e": "decreases"}


def test_inference_tensors_are_refused():
    with torch.inference_mode():
        made_inside = lin()
        x = torch.ones(4, 2)
    with pytest.raises(SpecError, match=r"weight is an inference tensor .*outside torch.inference_mode"):
        gradprobe.probe(made_inside, _fit, torch.ones(4, 2))
    with pytest.raises(SpecError, match=r"batch is an inference tensor .*\.clone\(\)"):
        gradprobe.probe(lin(), _fit, x)


def test_a_step_that_raises_before_its_terms_are_known_names_its_line() -> None:
    # Issue 34: without terms= the error still says where in the user's step it came from.
    def step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise KeyError("coords")  # the batch holds "pos"

    with pytest.raises(gradprobe.StepContractError) as raised:
        gradprobe.probe(torch.nn.Linear(3, 1), step, {"pos": torch.randn(4, 3)}, progress=False)
    line = step.__code__.co_firstlineno + 1
    assert f'test_bad_input.py:{line} (raise KeyError("coords")' in str(raised.value)


def test_a_force_model_whose_coordinates_do_not_require_grad_is_told_about_differentiable_inputs() -> None:
    def step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        energy = model(batch["pos"]).sum()
        (grad,) = torch.autograd.grad(energy, batch["pos"], create_graph=True)
        return {"energy": energy, "force": grad.pow(2).sum()}

    with pytest.raises(gradprobe.StepContractError, match=r"differentiable_inputs=\[key\]"):
        gradprobe.probe(torch.nn.Linear(3, 1), step, {"pos": torch.randn(4, 3)}, progress=False)
    fm = gradprobe.probe(torch.nn.Linear(3, 1), step, {"pos": torch.randn(4, 3)}, differentiable_inputs=["pos"],
                         progress=False)  # fmt: skip
    assert fm.count("eager", "force only") == (1, 2)  # the weight; the bias has no force
