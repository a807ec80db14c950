"""The lineage recorder: which parameters each term's value depends on, which carry gradient, and the
cut site in between — checked against what autograd and finite differences say, mechanism by mechanism."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx

from gradprobe.evidence.lineage import record

A = ("a.weight", "a.bias")


class _NoGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        y = x * 2
        ctx.mark_non_differentiable(y)
        return y

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return None


class _Doubled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x * 2

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return g * 2


def _cut(h: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "detach":
        return h.detach()
    if kind == "data":
        return h.data
    if kind == "no_grad":
        with torch.no_grad():
            return h * 2
    if kind == "inference_mode":
        with torch.inference_mode():
            g = h * 2
        return g.clone()
    if kind == "tolist":
        return torch.tensor(h.tolist())
    if kind == "numpy":
        return torch.from_numpy(h.detach().numpy())
    if kind == "int_cast":
        return (h * 10).long().to(h.dtype)
    if kind == "new_tensor":
        return h.new_tensor(h)
    if kind == "custom_function":
        return _NoGradient.apply(h)
    raise AssertionError(kind)


class Two(nn.Module):
    """``a`` feeds the cut term ``t``; ``c`` feeds ``other``, which also reaches ``a``'s weight."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.a, self.b, self.c = nn.Linear(3, 4), nn.Linear(4, 1), nn.Linear(3, 1)

    def forward(self, x):  # type: ignore[no-untyped-def]
        h = torch.tanh(self.a(x))
        return {"t": self.b(_cut(h, self.kind)).sum(), "other": self.c(x).sum() + self.a.weight.pow(2).sum()}


def _record(model: nn.Module, call):  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return record(model, list(model.named_parameters()), call, "test", lambda r: r)


@pytest.mark.parametrize(
    ("kind", "site"),
    [
        ("detach", "detach"),
        ("data", "data"),
        ("no_grad", "no_grad"),
        ("inference_mode", "inference_mode"),
        ("tolist", "tolist"),  # matched by value when the data comes back: torch.tensor(x.tolist())
        ("numpy", "detach"),  # x.detach().numpy(): the detach cuts, the round trip is matched by value
        ("int_cast", "int_cast"),
        ("new_tensor", "non_differentiable"),  # a copy autograd does not see through
        ("custom_function", "non_differentiable"),  # mark_non_differentiable
    ],
)
def test_each_cut_is_seen_even_when_another_term_reaches_the_parameter(kind, site):
    torch.manual_seed(0)
    model = Two(kind)
    x = torch.randn(5, 3)
    lin = _record(model, lambda: model(x))
    assert lin.error is None
    t = lin.terms["t"]
    assert set(t.cut) == set(A)  # depends on a.* by value, no gradient reaches them from t
    assert set(t.depends_on) >= set(A) | {"b.weight", "b.bias"}
    # Autograd agrees: t's gradient to a.* is None, while "other" still reaches a.weight.
    grads = torch.autograd.grad(model(x)["t"], [model.a.weight], allow_unused=True)
    assert grads[0] is None or not grads[0].any()
    assert not lin.terms["other"].cut
    kinds = {s.kind for s in lin.sites if s.id in t.sites}
    assert site in kinds, (kinds, lin.sites)


@pytest.mark.parametrize("kind", ["mask", "relu", "good_function", "straight_through", "times_zero"])
def test_masks_relu_differentiable_functions_and_zero_products_are_not_cuts(kind):
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 1)

        def forward(self, x):  # type: ignore[no-untyped-def]
            h = torch.tanh(self.a(x))
            if kind == "mask":
                h = h * (h > 0)
            elif kind == "relu":
                h = torch.relu(h)
            elif kind == "good_function":
                h = _Doubled.apply(h)
            elif kind == "straight_through":
                h = h + (h.round() - h).detach()
            elif kind == "times_zero":
                h = h * 0.0  # depends on nothing any more: not a cut either
            return {"t": self.b(h).sum()}

    torch.manual_seed(0)
    model = Net()
    lin = _record(model, lambda: model(torch.randn(5, 3)))
    assert lin.terms["t"].cut == ()
    if kind == "times_zero":
        assert set(lin.terms["t"].depends_on) == {"b.weight", "b.bias"}


def test_leaving_as_a_python_number_is_a_leaving_site_not_a_cut():
    # The number comes back as a scalar; lineage cannot follow it: finite differences decide later.
    model = Two("detach")
    x = torch.randn(5, 3)

    def step():  # type: ignore[no-untyped-def]
        h = torch.tanh(model.a(x))
        scale = float(h.sum())
        return {"t": model.b(torch.ones(5, 4)).sum() * scale}

    lin = _record(model, step)
    (site,) = lin.sites
    assert site.kind == "float" and site.leaving and set(site.parameters) == set(A)
    assert set(lin.terms["t"].depends_on) >= set(A)  # the scalar is matched by its value


class Pot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(3, 8), nn.Linear(8, 1)
        self.shift = nn.Parameter(torch.zeros(()))

    def forward(self, pos):  # type: ignore[no-untyped-def]
        pos = pos.clone().requires_grad_(True)
        e = self.l2(torch.tanh(self.l1(pos))).sum() + self.shift
        (f,) = torch.autograd.grad(e, pos, create_graph=self.training)
        return {"E": e, "F": f.pow(2).sum()}


def test_second_order_terms_depend_exactly_on_what_enters_the_backward():
    torch.manual_seed(0)
    model = Pot()
    lin = _record(model, lambda: model(torch.randn(5, 3)))
    # dE/dx does not depend on the shift or the output bias: seen op by op in the backward.
    assert set(lin.terms["F"].depends_on) == {"l1.weight", "l1.bias", "l2.weight"}
    assert lin.terms["F"].cut == () and lin.sites == []
    model.eval()
    lin = _record(model, lambda: model(torch.randn(5, 3)))
    (site,) = lin.sites
    assert site.kind == "autograd_grad_no_create_graph" and "eval mode" in site.detail
    assert set(lin.terms["F"].cut) == {"l1.weight", "l1.bias", "l2.weight"}


@pytest.mark.parametrize("stack_traces", [True, False])
def test_a_replayed_make_fx_graph_is_seen_node_by_node(stack_traces):
    torch.manual_seed(0)
    model = Pot()
    params = dict(model.named_parameters())
    pos = torch.randn(5, 3)
    gm = make_fx(lambda p, x: functional_call(model, p, (x,)), record_stack_traces=stack_traces)(params, pos)
    lin = _record(model, lambda: gm(params, pos))
    # make_fx recorded detach nodes on the saved tanh output (PyTorch #175477): the force loses l1.bias.
    assert lin.terms["F"].cut == ("l1.bias",)
    (site,) = [s for s in lin.sites if s.id in lin.terms["F"].sites]
    assert site.container == "fx" and site.node.startswith("detach") and site.feeds_backward
    if stack_traces:
        assert site.file == __file__ and "torch.tanh(self.l1(pos))" in site.code
    else:
        assert site.file == ""


def test_a_compiled_function_runs_its_python_under_the_recorder_and_stays_compiled():
    torch.manual_seed(0)
    model = Two("detach")
    x = torch.randn(5, 3)
    calls = []

    def counting(gm, example_inputs):  # type: ignore[no-untyped-def]
        def run(*args):  # type: ignore[no-untyped-def]
            calls.append(1)
            return gm.forward(*args)

        return run

    compiled = torch.compile(lambda xx: model(xx), backend=counting)
    compiled(x)
    before = len(calls)
    lin = _record(model, lambda: compiled(x))
    assert set(lin.terms["t"].cut) == set(A) and len(calls) == before  # eager Python, compiled code off
    compiled(x)
    assert len(calls) == before + 1  # still compiled afterwards: no skip mark left by the recorder


def test_numpy_math_loses_the_lineage_and_leaves_it_to_finite_differences():
    model = Two("detach")
    x = torch.randn(5, 3)

    def step():  # type: ignore[no-untyped-def]
        h = torch.tanh(model.a(x))
        back = torch.from_numpy(np.tanh(h.detach().numpy()))
        return {"t": model.b(back).sum()}

    lin = _record(model, step)
    assert not set(A) & set(lin.terms["t"].depends_on)  # lost in NumPy
    assert {s.kind for s in lin.sites} == {"detach", "numpy"}
