"""The probe leaves the user's model exactly as it found it."""

import random

import pytest
import torch
from torch import nn

import gradprobe


class Messy(nn.Module):
    """BatchNorm (running stats change in train mode), dropout (draws RNG), a frozen layer,
    a submodule in eval mode while the rest trains."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 8)
        self.norm = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head_a = nn.Linear(8, 1)
        self.head_b = nn.Linear(8, 1)
        self.head_b.eval()

    def forward(self, x):
        h = self.frozen(self.drop(self.norm(torch.tanh(self.inp(x)))))
        return self.head_a(h), self.head_b(h)


def step(model, batch):
    a, b = model(batch)
    # A step with side effects on the model: in-place edits of a parameter and of .grad.
    with torch.no_grad():
        model.head_a.bias.add_(1.0)
    model.head_b.weight.grad = torch.full_like(model.head_b.weight, 7.0)
    model.train()
    return {"a": a.pow(2).mean(), "b": b.pow(2).mean()}


def weights_step(model, batch, weights):
    terms = step(model, batch)
    return weights["a"] * terms["a"] + weights["b"] * terms["b"]


def snapshot(model):
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "grad_ids": {n: id(p.grad) for n, p in model.named_parameters()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "modes": {n: m.training for n, m in model.named_modules()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "rng": torch.get_rng_state(),
        "py_rng": random.getstate(),
        "grad_mode": torch.is_grad_enabled(),
    }


def assert_same(before, after):
    for key in ("params", "buffers"):
        for n, t in before[key].items():
            assert torch.equal(t, after[key][n]), f"{key} {n} changed"
    for n, g in before["grads"].items():
        assert (g is None) == (after["grads"][n] is None), n
        if g is not None:
            assert torch.equal(g, after["grads"][n]), f"grad {n} changed"
    assert before["grad_ids"] == after["grad_ids"], "the .grad objects were replaced"
    for key in ("requires_grad", "modes", "py_rng", "grad_mode"):
        assert before[key] == after[key], key
    assert torch.equal(before["rng"], after["rng"])


@pytest.mark.parametrize(("the_step", "mode"), [(step, "terms"), (weights_step, "weights")])
@pytest.mark.parametrize("grad_mode", [True, False])
def test_model_state_is_restored(the_step, mode, grad_mode):
    torch.manual_seed(0)
    model = Messy()
    model.inp.weight.grad = torch.ones_like(model.inp.weight)  # the user has pending grads
    batch = torch.randn(16, 3)
    before = snapshot(model)
    torch.set_grad_enabled(grad_mode)
    try:
        before["grad_mode"] = grad_mode
        fm = gradprobe.probe(model, the_step, batch, terms=["a", "b"], mode=mode)
        after = snapshot(model)
    finally:
        torch.set_grad_enabled(True)
    assert_same(before, after)
    # The probe measured something real while it was at it.
    assert "head_a.weight" in fm.reached("eager", "a only")
    assert fm.cell("eager", "a only", "frozen.weight").status == "none"
    assert fm.count("eager", "all")[1] == 8  # frozen parameters are not counted as trainable


def test_state_restored_when_the_step_raises_a_contract_error():
    model = Messy()
    batch = torch.randn(4, 3)
    before = snapshot(model)

    def bad(m, b):
        m(b)
        with torch.no_grad():
            m.inp.weight.mul_(0)
        return {"a": torch.ones(3, requires_grad=True)}  # not a scalar

    with pytest.raises(gradprobe.StepContractError):
        gradprobe.probe(model, bad, batch)
    assert_same(before, snapshot(model))


def test_batch_is_not_modified_by_differentiable_inputs():
    model = nn.Linear(3, 1)
    batch = {"x": torch.randn(4, 3)}

    def f(m, b):
        assert b["x"].requires_grad
        return {"y": m(b["x"]).sum()}

    gradprobe.probe(model, f, batch, differentiable_inputs=["x"])
    assert not batch["x"].requires_grad
