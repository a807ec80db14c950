"""gradprobe.locate names the module, op and exact source line where a gradient chain breaks."""

from __future__ import annotations

import inspect
import json
import os

import pytest
import torch
from torch import nn
from torch.autograd import grad as imported_grad

from gradprobe.evidence.locate import Break, frontier, locate_breaks, locate_nonfinite_backward, module_reach
from gradprobe.zoo import ReferencePotential, make_batch, potential, terms_step

HERE = os.path.abspath(__file__)


def source_line(obj, marker: str) -> tuple[int, str]:
    """(line number, stripped text) of the one line of ``obj``'s source that contains ``marker``."""
    lines, start = inspect.getsourcelines(obj)
    hits = [(start + i, text.strip()) for i, text in enumerate(lines) if marker in text]
    assert len(hits) == 1, hits
    return hits[0]


def seeded(factory):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return factory()


# ---------------------------------------------------------------------------- one break per model
class Cut(nn.Module):
    """``lin`` feeds a cut; ``out`` reads after it. Subclasses cut the chain in one way each."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.out = nn.Linear(4, 1)


class DetachCut(Cut):
    def forward(self, x):
        h = torch.tanh(self.lin(x))
        h = h.detach()  # cut: detach
        return self.out(h)


class NoGradCut(Cut):
    def forward(self, x):
        with torch.no_grad():
            h = self.lin(x)  # cut: no_grad
        return self.out(h)


class ItemCut(Cut):
    def forward(self, x):
        h = self.lin(x)
        s = torch.tensor(h.sum().item())  # cut: item
        return self.out(x.new_ones(4)) * s


class LongCut(Cut):
    def forward(self, x):
        k = self.lin(x).sum().long()  # cut: int_cast
        return self.out(x.new_ones(4)) * k


class NumpyCut(Cut):
    def forward(self, x):
        h = torch.from_numpy(self.lin(x).detach().numpy())  # cut: numpy
        return self.out(h)


class NoCut(Cut):
    def forward(self, x):
        return self.out(torch.tanh(self.lin(x)))


class Net(nn.Module):
    def __init__(self, cut: type[Cut]) -> None:
        super().__init__()
        self.pre = nn.Linear(3, 3)
        self.cut = cut()

    def forward(self, x):
        return self.cut(torch.tanh(self.pre(x))).sum()


CUT_PARAMS = ("pre.weight", "pre.bias", "cut.lin.weight", "cut.lin.bias")


@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad=True")
@pytest.mark.parametrize(
    ("cut", "kinds", "op", "module", "module_type"),
    [
        (DetachCut, ["detach"], "Tensor.detach", "cut", "DetachCut"),
        (NoGradCut, ["no_grad"], "torch.nn.functional.linear", "cut.lin", "Linear"),
        (ItemCut, ["item"], "Tensor.item", "cut", "ItemCut"),
        (LongCut, ["int_cast"], "Tensor.long", "cut", "LongCut"),
        (NumpyCut, ["detach", "numpy"], "Tensor.detach", "cut", "NumpyCut"),
    ],
)
def test_each_break_is_named_by_kind_module_line_and_parameters(cut, kinds, op, module, module_type):
    model = seeded(lambda: Net(cut))
    x = torch.randn(5, 3)
    breaks = locate_breaks(model, lambda: {"loss": model(x)})
    line, code = source_line(cut.forward, "# cut:")
    assert [b.kind for b in breaks] == kinds
    assert breaks[0].op == op
    for brk in breaks:
        assert (brk.module, brk.module_type) == (module, module_type)
        assert (brk.file, brk.line, brk.code) == (HERE, line, code)
        assert brk.parameters == CUT_PARAMS
    json.dumps([b.to_dict() for b in breaks])  # plain data


def test_a_clean_model_has_no_breaks():
    model = seeded(lambda: Net(NoCut))
    x = torch.randn(5, 3)
    assert locate_breaks(model, lambda: {"loss": model(x)}) == []


def test_a_term_built_from_the_training_gradient_without_create_graph_is_cut():
    # A gradient penalty computed with create_graph=False gets no gradient itself: a cut at that line.
    model = seeded(lambda: Net(NoCut))
    x = torch.randn(5, 3)

    def step():
        loss = model(x)
        grads = torch.autograd.grad(loss, list(model.parameters()))  # the penalty's cut
        return {"loss": loss, "norm": torch.stack([g.norm() for g in grads]).sum()}

    (brk,) = locate_breaks(model, step)
    line, _ = source_line(
        test_a_term_built_from_the_training_gradient_without_create_graph_is_cut, "# the" + " penalty"
    )
    assert (brk.kind, brk.op, brk.line, brk.detail) == ("autograd_grad_no_create_graph", "torch.autograd.grad", line,
                                                         "create_graph=False")  # fmt: skip


# ---------------------------------------------------------------------------- the zoo potential
@pytest.fixture(scope="module")
def zoo():
    return seeded(lambda: ReferencePotential().double()), make_batch()


def test_zoo_potential_in_eval_mode_breaks_at_its_force_autograd_grad(zoo):
    model, batch = zoo
    model.eval()
    try:
        breaks = locate_breaks(model, lambda: terms_step(model, batch))
    finally:
        model.train()
    line, code = source_line(ReferencePotential.forward, "torch.autograd.grad(")
    assert [b.kind for b in breaks] == ["autograd_grad_no_create_graph"]
    (brk,) = breaks
    assert (brk.op, brk.module, brk.module_type) == ("torch.autograd.grad", "", "ReferencePotential")
    assert (brk.file, brk.line, brk.code) == (os.path.abspath(potential.__file__), line, code)
    assert "eval mode" in brk.detail
    # The force depends on every parameter except the auxiliary head and those with no effect on
    # dE/dx: the per-type energy shift and the output bias (seen op by op in the backward).
    no_force = ("aux_head.", "energy_shift", "fitting.out.bias")
    expected = [n for n, _ in model.named_parameters() if not n.startswith(no_force)]
    assert list(brk.parameters) == expected


def test_zoo_potential_in_train_mode_has_no_break(zoo):
    # Its neighbour list runs under no_grad and it detaches coordinates: data, not parameters.
    model, batch = zoo
    assert model.training
    assert locate_breaks(model, lambda: terms_step(model, batch)) == []


# ---------------------------------------------------------------------------- autograd.grad misuse
class UnusedInput(nn.Module):
    def __init__(self, allow_unused: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.allow_unused = allow_unused

    def forward(self, x_in):
        x_in = x_in.clone().requires_grad_(True)
        x = x_in.clone().detach()  # re-created before use: the model never sees x_in
        energy = self.lin(x).sum()
        try:
            (g,) = torch.autograd.grad(energy, x_in, create_graph=True, allow_unused=self.allow_unused)  # cut
        except RuntimeError:
            g = None
        return energy + (0.0 if g is None else g.sum())


@pytest.mark.parametrize("allow_unused", [True, False])
def test_differentiating_an_unused_input_is_named(allow_unused):
    model = seeded(lambda: UnusedInput(allow_unused))
    breaks = locate_breaks(model, lambda: {"loss": model(torch.randn(4, 3))})
    line, code = source_line(UnusedInput.forward, "# cut")
    assert [(b.kind, b.module, b.module_type) for b in breaks] == [
        ("autograd_grad_unused_input", "", "UnusedInput")
    ]
    assert (breaks[0].file, breaks[0].line, breaks[0].code) == (HERE, line, code)
    assert breaks[0].parameters == ("lin.weight", "lin.bias")


class ImportedGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)

    def forward(self, x):
        x = x.clone().requires_grad_(True)
        energy = self.lin(torch.tanh(x)).sum()
        (g,) = imported_grad(energy, x)  # cut: bound before the patch, seen through dispatch
        return energy + g.sum()


def test_an_imported_autograd_grad_without_create_graph_is_named():
    model = seeded(ImportedGrad)
    breaks = locate_breaks(model, lambda: {"loss": model(torch.randn(4, 3))})
    line, code = source_line(ImportedGrad.forward, "# cut")
    assert [(b.kind, b.module, b.line, b.code, b.detail) for b in breaks] == [
        ("autograd_grad_no_create_graph", "", line, code, "create_graph=False")
    ]
    # dE/dx = lin.weight-dependent only: the bias does not enter the backward.
    assert breaks[0].parameters == ("lin.weight",)


# ---------------------------------------------------------------------------- NaN and Inf
class InvR(nn.Module):
    """1/r with a ``where`` mask over r = 0: the forward is finite, the backward is 0 * inf = NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3, bias=False)

    def forward(self, x):
        r2 = (self.lin(x) ** 2).sum(-1)
        mask = x.abs().sum(-1) > 0
        return torch.where(mask, 1 / torch.sqrt(r2), 0.0).sum()  # nan in backward


class LogNeg(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        y = torch.tanh(self.lin(x))
        return torch.log(y - 2.0).sum()  # nan in forward


def test_nonfinite_backward_names_the_forward_line_of_the_singular_op():
    model = seeded(InvR)
    x = torch.randn(4, 3)
    x[1] = 0.0  # lin has no bias: r = 0 for this row

    def step():
        return {"loss": model(x)}

    assert torch.isfinite(step()["loss"])
    brk = locate_nonfinite_backward(model, step, "loss")
    line, code = source_line(InvR.forward, "# nan in backward")
    assert brk is not None
    assert (brk.kind, brk.module, brk.module_type) == ("nonfinite", "", "InvR")
    assert brk.op.endswith("Backward0")
    assert (brk.file, brk.line, brk.code) == (HERE, line, code)
    assert brk.parameters == ("lin.weight",)
    assert not torch.is_anomaly_enabled()
    x[1] = 1.0
    assert locate_nonfinite_backward(model, step, "loss") is None


class Force(nn.Module):
    """A force loss through autograd.grad(create_graph=True); r = 0 for an atom at the origin."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(1, 1)

    def forward(self, coord):
        coord = coord.detach().requires_grad_(True)
        r2 = (coord**2).sum(-1)  # nan in the force's backward
        energy = self.lin(torch.sqrt(r2)[:, None]).sum()
        force = -torch.autograd.grad(energy, coord, create_graph=True)[0]  # nan force
        return {"force": (force**2).sum()}


def test_nonfinite_inside_the_steps_own_backward_is_located():
    model = seeded(Force)
    coord = torch.randn(3, 3)
    coord[0] = 0.0
    # sqrt's backward makes inf at r = 0; anomaly mode names the first op whose backward turns it to NaN.
    brk = locate_nonfinite_backward(model, lambda: model(coord), "force")
    line, code = source_line(Force.forward, "# nan in the force's backward")
    assert brk is not None
    assert (brk.op, brk.module, brk.module_type, brk.line, brk.code) == (
        "PowBackward0",
        "",
        "Force",
        line,
        code,
    )
    # The forward check sees it inside the step's autograd.grad, at the backward op that makes it.
    breaks = locate_breaks(model, lambda: model(coord), check_nonfinite=True)
    line, code = source_line(Force.forward, "# nan force")
    assert [(b.kind, b.op, b.line, b.code) for b in breaks] == [
        ("nonfinite", "torch.autograd.grad", line, code)
    ]
    assert "aten." in breaks[0].detail
    assert breaks[0].parameters == ("lin.weight",)  # the bias does not enter dE/dx


def test_nonfinite_forward_is_named_only_when_asked():
    model = seeded(LogNeg)
    x = torch.randn(4, 3)
    assert locate_breaks(model, lambda: {"loss": model(x)}) == []
    breaks = locate_breaks(model, lambda: {"loss": model(x)}, check_nonfinite=True)
    line, code = source_line(LogNeg.forward, "# nan in forward")
    assert [(b.kind, b.op, b.module, b.line, b.code) for b in breaks] == [
        ("nonfinite", "torch.log", "", line, code)
    ]
    assert breaks[0].parameters == ("lin.weight", "lin.bias")


def test_a_deliberate_inf_argument_is_not_reported():
    lin = seeded(lambda: nn.Linear(3, 3))
    x = torch.randn(2, 3)
    mask = torch.tensor([[True, False, True], [False, False, True]])
    step = lambda: {"loss": torch.softmax(lin(x).masked_fill(mask, float("-inf")), -1).sum()}  # noqa: E731
    assert locate_breaks(lin, step, check_nonfinite=True) == []


# ---------------------------------------------------------------------------- module frontier
class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(3, 4)
        self.lin2 = nn.Linear(4, 1)

    def forward(self, h):
        return self.lin2(torch.tanh(self.lin1(h)).detach())


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(3, 3)
        self.head_a = Inner()
        self.head_b = nn.Linear(3, 1)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return {"a": self.head_a(h), "b": self.head_b(h.detach())}


def test_module_reach_and_frontier_bracket_the_break():
    model = seeded(TwoHeads)
    x = torch.randn(5, 3)

    def step():
        out = model(x)
        return {"main": out["a"].sum() + 0.0 * out["b"].sum()}

    reach = module_reach(model, step, "main")
    assert reach == {
        "": "nonzero",
        "body": "none",
        "head_a": "nonzero",
        "head_a.lin1": "none",
        "head_a.lin2": "nonzero",
        "head_b": "zero",
    }
    unreached = ["body.weight", "body.bias", "head_a.lin1.weight", "head_a.lin1.bias"]
    # head_a's output is reached but lin1's parameters are not: the cut is inside head_a's forward.
    assert frontier(reach, unreached) == ["", "head_a"]
    assert frontier({}, ["head_a.lin1.weight", "body.bias"]) == ["head_a.lin1", "body"]


# ---------------------------------------------------------------------------- the user's state
def _global_state():
    from torch.nn.modules import module

    return (
        len(module._global_forward_hooks),
        len(module._global_forward_pre_hooks),
        torch.autograd.grad,
        torch.is_grad_enabled(),
        torch._C._len_torch_function_stack(),
    )


@pytest.mark.parametrize("fails", [False, True])
def test_state_is_restored_even_when_the_step_raises(fails):
    model = seeded(lambda: Net(DetachCut)).eval()
    model.cut.train()
    before = _global_state()
    modes = [m.training for m in model.modules()]

    def step():
        loss = model(torch.randn(2, 3))
        if fails:
            raise ValueError("step failed")
        return {"loss": loss}

    if fails:
        with pytest.raises(ValueError, match="step failed") as info:
            locate_breaks(model, step)
        assert any("detach at" in note for note in info.value.__notes__)
    else:
        assert [b.kind for b in locate_breaks(model, step)] == ["detach"]
    assert _global_state() == before
    assert [m.training for m in model.modules()] == modes
    assert all(p.grad is None for p in model.parameters())


def test_break_to_dict_round_trips():
    brk = Break("item", "Tensor.item", "", "Net", "f.py", 3, "x.item()", ("w",))
    assert Break(**{**brk.to_dict(), "parameters": tuple(brk.to_dict()["parameters"])}) == brk
