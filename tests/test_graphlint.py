"""The graph lint on traces gradprobe did not make: parameters baked into the graph as attributes (what
DeePMD's make_fx of ``forward_lower`` does) count as parameters; detach on coordinates alone does not."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from gradprobe.evidence.graphlint import lint


def _force_loss(layer: torch.nn.Module):  # type: ignore[no-untyped-def]
    def f(x: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_(True)  # a boundary detach on the coordinates: harmless
        energy = torch.tanh(layer(x)).sum()
        (grad,) = torch.autograd.grad(energy, x, create_graph=True)
        return grad.pow(2).sum()

    return f


def test_parameters_baked_in_as_attributes_are_parameters() -> None:
    gm = make_fx(_force_loss(torch.nn.Linear(3, 1)))(torch.randn(4, 3))
    assert sum(n.op == "get_attr" for n in gm.graph.nodes) == 2  # _param_constant0/1
    found = lint(gm, 0)
    # make_fx saved the tanh output and the weight for the backward behind detach nodes: they cut
    # d(force)/d(params); the boundary detach on x depends on no parameter and is not counted.
    assert found["detach_nodes"] == 3 and found["cutting_detach_nodes"] == 2
    assert found["first_detach"]["saved"]["op"] in ("tanh.default", "t.default")


def test_frozen_attributes_are_not_parameters() -> None:
    layer = torch.nn.Linear(3, 1).requires_grad_(False)
    found = lint(make_fx(_force_loss(layer))(torch.randn(4, 3)), 0)
    assert found["cutting_detach_nodes"] == 0
