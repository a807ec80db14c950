"""A Hamiltonian neural network for a double spring (2 degrees of freedom): H(q, p) is learned, the
vector field is (dH/dp, -dH/dq), fitted to observed time derivatives. Both derivatives are taken by
``autograd.grad`` on the input, so the fit is a second-order term for the parameters.

Bug: dH/dp is taken in a second ``autograd.grad`` call with ``retain_graph=True`` but without
``create_graph=True`` (the usual "fix" for "backward through the graph a second time"). dH/dq still
carries gradient, so every parameter is reached; only the values are wrong.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as nnf

from . import autograd_of, case, fd_vs_autograd, grown, params_of, reached, truth, worst_disagreement

CASE = "hnn-second-call-no-create-graph"
VELOCITY_WEIGHT = 0.25  # velocities are observed with twice the noise of the force rates
# With it the bug moves the gradient of "flow" by about 33% (relative L2 over all parameters).


class SpringHNN(nn.Module):
    def __init__(self, exact: bool) -> None:
        super().__init__()
        self.exact = exact
        self.lift = nn.Linear(4, 24)
        self.mix = nn.Linear(24, 24)
        self.energy = nn.Linear(24, 1, bias=False)

    def forward(self, q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        z = torch.tanh(self.lift(torch.cat([q, p], dim=-1)))
        return self.energy(nnf.softplus(self.mix(z))).squeeze(-1)

    def vector_field(self, q: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self(q, p).sum()
        (dh_dq,) = torch.autograd.grad(h, q, create_graph=True)
        if self.exact:
            (dh_dp,) = torch.autograd.grad(h, p, create_graph=True)
        else:
            (dh_dp,) = torch.autograd.grad(h, p, retain_graph=True)  # ROOT hnn-second-call-no-create-graph
        return dh_dp, -dh_dq


def spring_batch(n: int = 32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    q = torch.randn(n, 2, generator=g, dtype=torch.float64)
    p = torch.randn(n, 2, generator=g, dtype=torch.float64)
    k = torch.tensor([1.0, 2.5], dtype=torch.float64)  # H = |p|^2 / 2 + k q^2 / 2
    return {"q": q, "p": p, "q_rate": p.clone(), "p_rate": -k * q, "h_ref": 0.5 * (p**2 + k * q**2).sum(-1)}


def fit_step(model: SpringHNN, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    q = batch["q"].clone().requires_grad_(True)
    p = batch["p"].clone().requires_grad_(True)
    q_rate, p_rate = model.vector_field(q, p)
    flow = (
        VELOCITY_WEIGHT * ((q_rate - batch["q_rate"]) ** 2).mean() + ((p_rate - batch["p_rate"]) ** 2).mean()
    )
    anchor = ((model(batch["q"], batch["p"]) - batch["h_ref"]) ** 2).mean()
    return {"flow": flow, "anchor": anchor}


@case(
    CASE, family="hamiltonian", mechanism="autograd.grad without create_graph", expect={"gradient-mismatch"}
)
def build(fixed: bool):
    return grown(1, lambda: SpringHNN(exact=fixed)), fit_step, spring_batch(), {}


@truth(CASE)
def check(fixed: bool) -> None:
    model, step, batch, _ = build(fixed)
    params = params_of(model)
    grads = autograd_of(step(model, batch)["flow"], params)
    assert all(reached(g) for g in grads.values()), "every parameter is reached, bug or not"
    off = worst_disagreement(fd_vs_autograd(lambda: step(model, batch)["flow"], params))
    if fixed:
        assert off < 1e-6, off
        return
    assert off > 0.1, off
    good_model, _, _, _ = build(True)
    good = autograd_of(step(good_model, batch)["flow"], params_of(good_model))
    flat_bad = torch.cat([g.flatten() for g in grads.values() if g is not None])
    flat_good = torch.cat([g.flatten() for g in good.values() if g is not None])
    rel = float((flat_bad - flat_good).norm() / flat_good.norm())
    assert 0.2 < rel < 0.45, rel
