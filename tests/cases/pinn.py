"""A physics-informed MLP u(x, t) for the heat equation u_t = nu * u_xx with a learned diffusivity nu
(an inverse problem), and a ReLU variant for the advection equation u_t + c u_x = 0.

Terms: ``data`` (fit to observations) and ``residual`` (the PDE residual at collocation points, from
``autograd.grad(u, xt, create_graph=True)``: a second-order term for the parameters). float64.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx

import gradprobe

from . import (
    Case,
    Names,
    Setup,
    case_file,
    fresh,
    grads,
    is_cut,
    nudge,
    opaque,
    seeded,
    term_weights,
    user_run,
    weighted_total,
    with_twin,
)

FILE = case_file()
FAMILY = "pinn"
DTYPE = torch.float64
N_OBS, N_COL, WIDTH = 10, 24, 12
NU_TRUE, SPEED = 0.05, 0.5


class FieldNet(nn.Module):
    """u(x, t) and the PDE residual at collocation points."""

    def __init__(self, n: Names, act: type[nn.Module] = nn.Tanh, pde: str = "heat") -> None:
        super().__init__()
        self.pde = pde
        self.names = {base: n.attr(base) for base in ("body", "head", "log_nu")}
        body = nn.Sequential(nn.Linear(2, WIDTH), act(), nn.Linear(WIDTH, WIDTH), act())
        setattr(self, self.names["body"], body)
        setattr(self, self.names["head"], nn.Linear(WIDTH, 1))
        if pde == "heat":
            setattr(self, self.names["log_nu"], nn.Parameter(torch.tensor([math.log(0.1)])))

    def sub(self, base: str):
        return getattr(self, self.names[base])

    def nu(self) -> torch.Tensor:
        return self.sub("log_nu").exp()

    def u(self, xt: torch.Tensor) -> torch.Tensor:
        return self.sub("head")(self.sub("body")(xt)).squeeze(-1)

    def residual(self, xt: torch.Tensor, nu: torch.Tensor | None = None) -> torch.Tensor:
        xt = xt.clone().requires_grad_(True)
        u = self.u(xt)
        (du,) = torch.autograd.grad(u.sum(), xt, create_graph=True)
        u_x, u_t = du[:, 0], du[:, 1]
        if self.pde == "advection":
            return u_t + SPEED * u_x
        (ddu,) = torch.autograd.grad(u_x.sum(), xt, create_graph=True)
        return u_t - (self.nu() if nu is None else nu) * ddu[:, 0]

    def forward(self, xt_obs: torch.Tensor, xt_col: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.u(xt_obs), self.residual(xt_col)


def _keys(n: Names) -> tuple[str, str, str]:
    return n.key("xt_obs"), n.key("u_obs"), n.key("xt_col")


def _terms(n: Names) -> tuple[str, str]:
    return n.term("data"), n.term("residual")


def exact(xt: torch.Tensor, pde: str) -> torch.Tensor:
    x, t = xt[:, 0], xt[:, 1]
    if pde == "advection":
        return torch.sin(math.pi * (x - SPEED * t))
    return torch.exp(-NU_TRUE * math.pi**2 * t) * torch.sin(math.pi * x)


def _batch(n: Names, seed: int, pde: str = "heat") -> dict[str, torch.Tensor]:
    ko, ku, kc = _keys(n)
    g = torch.Generator().manual_seed(seed)
    xt_obs = torch.rand(N_OBS, 2, generator=g, dtype=DTYPE) * torch.tensor([2.0, 1.0], dtype=DTYPE)
    xt_col = torch.rand(N_COL, 2, generator=g, dtype=DTYPE) * torch.tensor([2.0, 1.0], dtype=DTYPE)
    return {ko: xt_obs - torch.tensor([1.0, 0.0], dtype=DTYPE), ku: exact(xt_obs, pde), kc: xt_col}


def _model(n: Names, **kw) -> FieldNet:
    with seeded(5):
        return FieldNet(n, **kw).to(DTYPE)


def _step(n: Names):
    ko, ku, kc = _keys(n)
    td, tr = _terms(n)

    def step(model, batch):
        u_hat, res = model(batch[ko], batch[kc])
        return {td: ((u_hat - batch[ku]) ** 2).mean(), tr: (res**2).mean()}

    return step


def _spec(n: Names, model: FieldNet, **extra) -> gradprobe.ProbeSpec:
    return gradprobe.ProbeSpec(
        model=model,
        step=_step(n),
        batch=_batch(n, 0, model.pde),
        terms=list(_terms(n)),
        mode="terms",
        name=FAMILY,
        **extra,
    )


def _weights(weights, names) -> dict[str, torch.Tensor]:
    return {t: weights[t] for t in names}


# ----- pinn-makefx-detach: the trainer replays a make_fx trace of the residual ------------------------


def build_makefx_detach(n: Names, bug: bool) -> Setup:
    ko, ku, kc = _keys(n)
    td, tr = _terms(n)
    alias = {torch.ops.aten.detach.default: torch.ops.aten.alias.default}

    def make_run(ctx):
        m = ctx.model
        params, buffers = dict(m.named_parameters()), dict(m.named_buffers())

        def losses(p, b, batch, w):
            u_hat, res = functional_call(m, {**p, **b}, (batch[ko], batch[kc]))
            terms = {td: ((u_hat - batch[ku]) ** 2).mean(), tr: (res**2).mean()}
            return weighted_total(terms, w), terms

        example = term_weights([td, tr], [td, tr], next(iter(params.values())))
        table = None if bug else alias  # BUG pinn-makefx-detach
        gm = make_fx(losses, decomposition_table=table, record_stack_traces=True)(
            params, buffers, ctx.batch, example
        )
        return lambda batch, weights: gm(params, buffers, batch, _weights(weights, (td, tr)))

    return Setup(_spec(n, _model(n)), ["eager", opaque(n.variant("replay"), make_run)])


def truth_makefx_detach(n: Names, bug: bool) -> None:
    setup = build_makefx_detach(n, bug)
    _, tr = _terms(n)
    model, batch = setup.spec.model, setup.spec.batch
    params = dict(model.named_parameters())
    only = term_weights(list(_terms(n)), [tr], next(model.parameters()))
    run = user_run(setup)
    value = run(batch, only)[1][tr]
    torch.testing.assert_close(value, setup.spec.step(model, batch)[tr])
    replay, eager = grads(value, params), grads(setup.spec.step(model, batch)[tr], params)
    lost = [k for k in params if is_cut(replay[k]) and not is_cut(eager[k])]
    wrong = [
        k
        for k in params
        if not is_cut(replay[k]) and not torch.allclose(replay[k], eager[k], rtol=1e-6, atol=1e-12)  # type: ignore[arg-type]
    ]
    if bug:
        # The hidden-layer biases reach the residual only through the saved tanh outputs.
        body = model.names["body"]
        assert {f"{body}.0.bias", f"{body}.2.bias"} <= set(lost), lost
        assert wrong, "the weights get wrong gradients too"
        assert nudge(lambda: run(batch, only)[1][tr], params[f"{body}.0.bias"]) > 1e-9
    else:
        assert not lost and not wrong, (lost, wrong)


# ----- pinn-infer-data: the trainer evaluates the observation fit under inference_mode -----------------


def build_infer_data(n: Names, bug: bool) -> Setup:
    ko, ku, kc = _keys(n)
    td, tr = _terms(n)

    def make_run(ctx):
        m = ctx.model

        def losses(batch, w):
            with torch.inference_mode() if bug else contextlib.nullcontext():
                u_hat = m.u(batch[ko])  # BUG pinn-infer-data
                data = ((u_hat - batch[ku]) ** 2).mean()
            terms = {td: data, tr: (m.residual(batch[kc]) ** 2).mean()}
            return weighted_total(terms, w), terms

        compiled = torch.compile(fresh(losses), backend="eager")
        return lambda batch, weights: compiled(batch, _weights(weights, (td, tr)))

    return Setup(_spec(n, _model(n)), ["eager", opaque(n.variant("trainer"), make_run)])


def truth_infer_data(n: Names, bug: bool) -> None:
    setup = build_infer_data(n, bug)
    td, _ = _terms(n)
    model, batch = setup.spec.model, setup.spec.batch
    run = user_run(setup)
    only = term_weights(list(_terms(n)), [td], next(model.parameters()))
    values = run(batch, only)[1]
    torch.testing.assert_close(values[td], setup.spec.step(model, batch)[td])
    got = grads(values[td], dict(model.named_parameters()))
    head = model.sub("head").weight
    if bug:
        assert not values[td].requires_grad and all(is_cut(g) for g in got.values())
        assert nudge(lambda: run(batch, only)[1][td], head) > 1e-9
    else:
        assert not is_cut(got[model.names["head"] + ".weight"])


# ----- pinn-tolist-clamp: the trainer clamps nu with Python floats ----------------------------------


def build_tolist_clamp(n: Names, bug: bool) -> Setup:
    ko, ku, kc = _keys(n)
    td, tr = _terms(n)

    def make_run(ctx):
        m = ctx.model

        def losses(batch, w):
            nu = m.nu()
            if bug:
                nu = torch.tensor([min(v, 1.0) for v in nu.tolist()], dtype=nu.dtype)  # BUG pinn-tolist-clamp
            else:
                nu = nu.clamp(max=1.0)
            u_hat = m.u(batch[ko])
            terms = {td: ((u_hat - batch[ku]) ** 2).mean(), tr: (m.residual(batch[kc], nu) ** 2).mean()}
            return weighted_total(terms, w), terms

        compiled = torch.compile(fresh(losses), backend="eager")
        return lambda batch, weights: compiled(batch, _weights(weights, (td, tr)))

    return Setup(_spec(n, _model(n)), ["eager", opaque(n.variant("trainer"), make_run)])


def truth_tolist_clamp(n: Names, bug: bool) -> None:
    setup = build_tolist_clamp(n, bug)
    _, tr = _terms(n)
    model, batch = setup.spec.model, setup.spec.batch
    run = user_run(setup)
    only = term_weights(list(_terms(n)), [tr], next(model.parameters()))
    value = run(batch, only)[1][tr]
    torch.testing.assert_close(value, setup.spec.step(model, batch)[tr])
    log_nu = model.sub("log_nu")
    (g,) = grads(value, {"log_nu": log_nu}).values()
    if bug:
        assert is_cut(g)
        assert nudge(lambda: run(batch, only)[1][tr], log_nu) > 1e-9
    else:
        assert not is_cut(g)


# ----- pinn-counter-recompile: the compiled loss bumps a metrics counter ---------------------------------


class Metrics:
    def __init__(self) -> None:
        self.calls = 0


def build_counter_recompile(n: Names, bug: bool) -> Setup:
    ko, ku, kc = _keys(n)
    td, tr = _terms(n)

    def make_run(ctx):
        m = ctx.model
        metrics = Metrics()

        def losses(batch, w):
            if bug:
                metrics.calls += 1  # BUG pinn-counter-recompile
            u_hat = m.u(batch[ko])
            terms = {td: ((u_hat - batch[ku]) ** 2).mean(), tr: (m.residual(batch[kc]) ** 2).mean()}
            return weighted_total(terms, w), terms

        compiled = torch.compile(fresh(losses), backend="eager")

        def run(batch, weights):
            if not bug:
                metrics.calls += 1  # counted outside the compiled code
            return compiled(batch, _weights(weights, (td, tr)))

        run.metrics = metrics  # type: ignore[attr-defined]
        return run

    return Setup(_spec(n, _model(n)), ["eager", opaque(n.variant("trainer"), make_run)])


def truth_counter_recompile(n: Names, bug: bool) -> None:
    from torch._dynamo.utils import counters

    setup = build_counter_recompile(n, bug)
    model, batch = setup.spec.model, setup.spec.batch
    run = user_run(setup)
    names = list(_terms(n))
    run(batch, term_weights(names, names[:1], next(model.parameters())))
    before = counters["stats"]["unique_graphs"]
    for on in (names[1:], names):
        run(batch, term_weights(names, on, next(model.parameters())))
    again = counters["stats"]["unique_graphs"] - before
    assert run.metrics.calls == 3  # type: ignore[attr-defined]
    assert (again > 0) if bug else (again == 0), again


# ----- healthy: a ReLU net's advection residual gives its biases exactly zero gradient -----------------


def build_relu_healthy(n: Names) -> Setup:
    return Setup(_spec(n, _model(n, act=nn.ReLU, pde="advection")), ["eager"])


def truth_relu_healthy(n: Names) -> None:
    setup = build_relu_healthy(n)
    _, tr = _terms(n)
    model, batch = setup.spec.model, setup.spec.batch
    params = dict(model.named_parameters())
    value = setup.spec.step(model, batch)[tr]
    got = grads(value, params)
    body = model.names["body"]
    for k in (f"{body}.0.bias", f"{body}.2.bias", model.names["head"] + ".bias"):
        assert is_cut(got[k]), k  # relu'' = 0: u_t and u_x do not depend on the biases locally
        assert nudge(lambda: setup.spec.step(model, batch)[tr], params[k], eps=1e-7) == 0.0, k
    assert not is_cut(got[f"{body}.0.weight"])


CASES: list[Case] = [
    *with_twin(
        Case(
            "pinn-makefx-detach",
            FAMILY,
            "makefx-detach",
            "make_fx-replay",
            build=build_makefx_detach,
            expect=frozenset({"makefx-detach"}),
            node="detach",
            notes="make_fx of the residual's autograd.grad(create_graph=True) records aten.detach: the "
            "residual loses the hidden biases and the weights get wrong gradients",
            file=FILE,
        ),
        build_makefx_detach,
        truth_makefx_detach,
    ),
    *with_twin(
        Case(
            "pinn-infer-data",
            FAMILY,
            "inference_mode",
            "opaque-compiled",
            build=build_infer_data,
            expect=frozenset({"graph-break-in-model"}),
            where="pinn-infer-data",
            notes="the observation fit is evaluated under inference_mode: data has no gradient at all",
            file=FILE,
        ),
        build_infer_data,
        truth_infer_data,
    ),
    *with_twin(
        Case(
            "pinn-tolist-clamp",
            FAMILY,
            "tolist",
            "opaque-compiled",
            build=build_tolist_clamp,
            expect=frozenset({"graph-break-in-model"}),
            where="pinn-tolist-clamp",
            notes="nu clamped through a Python list: residual never reaches log_nu (value unchanged)",
            file=FILE,
        ),
        build_tolist_clamp,
        truth_tolist_clamp,
    ),
    *with_twin(
        Case(
            "pinn-counter-recompile",
            FAMILY,
            "counter",
            "opaque-compiled",
            build=build_counter_recompile,
            expect=frozenset({"recompile-per-scenario"}),
            where="pinn-counter-recompile",
            notes="a metrics counter bumped inside the compiled loss: dynamo guards on its value",
            file=FILE,
        ),
        build_counter_recompile,
        truth_counter_recompile,
    ),
    Case(
        "pinn-relu-healthy",
        FAMILY,
        "relu-second-order",
        "reference",
        build=build_relu_healthy,
        healthy=True,
        truth=truth_relu_healthy,
        notes="ReLU: the advection residual's gradient for every bias is exactly zero, and so is the "
        "residual's change when a bias moves: not a cut",
        file=FILE,
    ),
]
