"""Message passing over an edge index on a small random mesh graph (nodes with 2-D coordinates).

Terms: ``node`` (regression of a per-node count) and ``smooth`` (edge consistency: neighbouring
predictions agree, weighted by a learned distance kernel exp(-d / tau)). float32.
"""

from __future__ import annotations

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
FAMILY = "graph_net"
NODES, FEATS, HIDDEN, ROUNDS = 8, 4, 10, 2


class MeshGNN(nn.Module):
    def __init__(self, n: Names) -> None:
        super().__init__()
        self.names = {base: n.attr(base) for base in ("embed", "message", "update", "readout", "log_tau")}
        setattr(self, self.names["embed"], nn.Linear(FEATS, HIDDEN))
        setattr(self, self.names["message"], nn.Linear(2 * HIDDEN, HIDDEN))
        setattr(self, self.names["update"], nn.Linear(2 * HIDDEN, HIDDEN))
        setattr(self, self.names["readout"], nn.Linear(HIDDEN, 1))
        setattr(self, self.names["log_tau"], nn.Parameter(torch.tensor(math.log(0.7))))

    def sub(self, base: str):
        return getattr(self, self.names[base])

    def tau(self) -> torch.Tensor:
        return self.sub("log_tau").exp()

    def forward(self, x: torch.Tensor, edges: torch.Tensor, coords: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per-node predictions and the edge kernel exp(-|x_i - x_j| / tau)."""
        src, dst = edges
        h = torch.tanh(self.sub("embed")(x))
        for _ in range(ROUNDS):
            m = torch.tanh(self.sub("message")(torch.cat([h[src], h[dst]], -1)))
            agg = torch.zeros_like(h).index_add(0, dst, m)
            h = h + torch.tanh(self.sub("update")(torch.cat([h, agg], -1)))
        return self.sub("readout")(h).squeeze(-1), self.kernel(edges, coords, self.tau())

    @staticmethod
    def kernel(edges: torch.Tensor, coords: torch.Tensor, tau) -> torch.Tensor:
        src, dst = edges
        return torch.exp(-(coords[src] - coords[dst]).norm(dim=-1) / tau)


def _keys(n: Names) -> tuple[str, str, str, str]:
    return n.key("feats"), n.key("edge_index"), n.key("coords"), n.key("counts")


def _terms(n: Names) -> tuple[str, str]:
    return n.term("node"), n.term("smooth")


def _batch(n: Names, seed: int) -> dict[str, torch.Tensor]:
    kx, ke, kc, ky = _keys(n)
    g = torch.Generator().manual_seed(seed)
    coords = torch.rand(NODES, 2, generator=g)
    ring = torch.arange(NODES)
    chords = torch.randint(NODES, (NODES,), generator=g)
    pairs = {(int(a), int(b)) for a, b in zip(ring, (ring + 1) % NODES, strict=True)}
    pairs |= {(int(a), int(b)) for a, b in zip(ring, chords, strict=True) if int(a) != int(b)}
    und = sorted({(min(a, b), max(a, b)) for a, b in pairs})
    edges = torch.tensor(und + [(b, a) for a, b in und]).T.contiguous()
    counts = torch.zeros(NODES).index_add(0, edges[1], torch.ones(edges.shape[1]))
    x = torch.cat([coords, torch.randn(NODES, FEATS - 2, generator=g)], -1)
    return {kx: x, ke: edges, kc: coords, ky: counts}


def _model(n: Names) -> MeshGNN:
    with seeded(13):
        return MeshGNN(n)


def round_ste(p: torch.Tensor) -> torch.Tensor:
    """Whole counts forward, the identity backward (straight-through)."""
    return p + (p.round() - p).detach()


def _step(n: Names, whole_counts: bool = False):
    kx, ke, kc, ky = _keys(n)
    tn, ts = _terms(n)

    def step(model, batch):
        pred, w = model(batch[kx], batch[ke], batch[kc])
        src, dst = batch[ke]
        fit = round_ste(pred) if whole_counts else pred
        return {tn: ((fit - batch[ky]) ** 2).mean(), ts: (w * (pred[src] - pred[dst]) ** 2).mean()}

    return step


def _spec(
    n: Names, step, model: nn.Module | None = None, second: bool = False, **extra
) -> gradprobe.ProbeSpec:
    return gradprobe.ProbeSpec(
        model=model if model is not None else _model(n),
        step=step,
        batch=_batch(n, 0),
        second_batch=_batch(n, 1) if second else None,
        terms=list(_terms(n)),
        mode="terms",
        name=FAMILY,
        **extra,
    )


def _weights(weights, names) -> dict[str, torch.Tensor]:
    return {t: weights[t] for t in names}


# ----- graph-int32-replay: the trainer casts predictions to the labels' integer dtype -----------------


def build_int32_replay(n: Names, bug: bool) -> Setup:
    kx, ke, kc, ky = _keys(n)
    tn, ts = _terms(n)

    def make_run(ctx):
        m = ctx.model
        params, buffers = dict(m.named_parameters()), dict(m.named_buffers())

        def losses(p, b, batch, w):
            pred, kern = functional_call(m, {**p, **b}, (batch[kx], batch[ke], batch[kc]))
            src, dst = batch[ke]
            whole = pred.round().to(torch.int32) if bug else round_ste(pred)  # BUG graph-int32-replay
            whole = whole.to(pred.dtype)
            terms = {tn: ((whole - batch[ky]) ** 2).mean(), ts: (kern * (pred[src] - pred[dst]) ** 2).mean()}
            return weighted_total(terms, w), terms

        example = term_weights([tn, ts], [tn, ts], next(iter(params.values())))
        gm = make_fx(losses)(params, buffers, ctx.batch, example)  # no stack traces: the node names the place
        return lambda batch, weights: gm(params, buffers, batch, _weights(weights, (tn, ts)))

    step = _step(n, whole_counts=True)
    return Setup(_spec(n, step), ["eager", opaque(n.variant("replay"), make_run)])


def truth_int32_replay(n: Names, bug: bool) -> None:
    setup = build_int32_replay(n, bug)
    tn, _ = _terms(n)
    model, batch = setup.spec.model, setup.spec.batch
    run = user_run(setup)
    only = term_weights(list(_terms(n)), [tn], next(model.parameters()))
    value = run(batch, only)[1][tn]
    torch.testing.assert_close(value, setup.spec.step(model, batch)[tn])
    got = grads(value, dict(model.named_parameters()))
    readout = model.sub("readout")
    if bug:
        assert all(is_cut(g) for k, g in got.items()), got
        # Whole counts: a 0.5 move of the readout bias crosses a rounding step for some node.
        assert nudge(lambda: run(batch, only)[1][tn], readout.bias, eps=0.5) > 1e-6
    else:
        assert not is_cut(got[model.names["readout"] + ".weight"])


# ----- graph-float-tau: the step's smoothness kernel takes tau as a Python float ---------------------


def build_float_tau(n: Names, bug: bool) -> Setup:
    kx, ke, kc, ky = _keys(n)
    tn, ts = _terms(n)

    def step(model, batch):
        pred, _ = model(batch[kx], batch[ke], batch[kc])
        src, dst = batch[ke]
        tau = float(model.tau()) if bug else model.tau()  # BUG graph-float-tau
        kern = model.kernel(batch[ke], batch[kc], tau)
        return {tn: ((pred - batch[ky]) ** 2).mean(), ts: (kern * (pred[src] - pred[dst]) ** 2).mean()}

    return Setup(_spec(n, step), ["eager"])


def truth_float_tau(n: Names, bug: bool) -> None:
    setup = build_float_tau(n, bug)
    _, ts = _terms(n)
    model, batch = setup.spec.model, setup.spec.batch
    log_tau = model.sub("log_tau")
    (g,) = grads(setup.spec.step(model, batch)[ts], {"log_tau": log_tau}).values()
    if bug:
        assert is_cut(g)
        assert nudge(lambda: setup.spec.step(model, batch)[ts], log_tau) > 1e-9
    else:
        assert not is_cut(g)


# ----- graph-item-recompile: the compiled loss reads the term weights as Python numbers ---------------


def build_item_recompile(n: Names, bug: bool) -> Setup:
    kx, ke, kc, ky = _keys(n)
    tn, ts = _terms(n)

    def make_run(ctx):
        m = ctx.model

        def losses(batch, w):
            pred, kern = m(batch[kx], batch[ke], batch[kc])
            src, dst = batch[ke]
            terms = {tn: ((pred - batch[ky]) ** 2).mean(), ts: (kern * (pred[src] - pred[dst]) ** 2).mean()}
            scales = (w[tn].item(), w[ts].item()) if bug else (w[tn], w[ts])  # BUG graph-item-recompile
            return scales[0] * terms[tn] + scales[1] * terms[ts], terms

        compiled = torch.compile(fresh(losses), backend="eager")
        return lambda batch, weights: compiled(batch, _weights(weights, (tn, ts)))

    return Setup(_spec(n, _step(n)), ["eager", opaque(n.variant("trainer"), make_run)])


def truth_item_recompile(n: Names, bug: bool) -> None:
    from torch._dynamo.utils import counters

    setup = build_item_recompile(n, bug)
    model, batch = setup.spec.model, setup.spec.batch
    run = user_run(setup)
    names = list(_terms(n))
    run(batch, term_weights(names, names[:1], next(model.parameters())))
    before = counters["stats"]["unique_graphs"]
    for on in (names[1:], names):
        run(batch, term_weights(names, on, next(model.parameters())))
    again = counters["stats"]["unique_graphs"] - before
    assert (again > 0) if bug else (again == 0), again


# ----- graph-frozen-tolist: the traced loss caches the edge kernel as a Python list ------------------


class CachedKernelLoss(nn.Module):
    """The trainer's loss module (traced once with make_fx; stack traces are kept for ``forward``)."""

    def __init__(self, model: MeshGNN, n: Names, bug: bool) -> None:
        super().__init__()
        self.model, self.bug = model, bug
        self.keys, self.terms = _keys(n), _terms(n)

    def forward(self, p, b, batch, w):
        kx, ke, kc, ky = self.keys
        pred, kern = functional_call(self.model, {**p, **b}, (batch[kx], batch[ke], batch[kc]))
        src, dst = batch[ke]
        if self.bug:
            kern = torch.tensor(kern.tolist(), dtype=kern.dtype)  # BUG graph-frozen-tolist
        tn, ts = self.terms
        terms = {tn: ((pred - batch[ky]) ** 2).mean(), ts: (kern * (pred[src] - pred[dst]) ** 2).mean()}
        return weighted_total(terms, w), terms


def build_frozen_tolist(n: Names, bug: bool) -> Setup:
    names = _terms(n)

    def make_run(ctx):
        params, buffers = dict(ctx.model.named_parameters()), dict(ctx.model.named_buffers())
        example = term_weights(names, names, next(iter(params.values())))
        loss = CachedKernelLoss(ctx.model, n, bug)
        gm = make_fx(loss, record_stack_traces=True)(params, buffers, ctx.batch, example)
        return lambda batch, weights: gm(params, buffers, batch, _weights(weights, names))

    return Setup(_spec(n, _step(n), second=True), ["eager", opaque(n.variant("replay"), make_run)])


def truth_frozen_tolist(n: Names, bug: bool) -> None:
    setup = build_frozen_tolist(n, bug)
    _, ts = _terms(n)
    model, batch, other = setup.spec.model, setup.spec.batch, setup.spec.second_batch
    run = user_run(setup)
    only = term_weights(list(_terms(n)), [ts], next(model.parameters()))
    value = run(batch, only)[1][ts]
    torch.testing.assert_close(value, setup.spec.step(model, batch)[ts])
    (g,) = grads(value, {"log_tau": model.sub("log_tau")}).values()
    gap = abs(float((run(other, only)[1][ts] - setup.spec.step(model, other)[ts]).detach()))
    if bug:
        assert is_cut(g)
        assert gap > 1e-5, gap  # the second graph is smoothed with the first graph's kernel
    else:
        assert not is_cut(g)
        assert gap < 1e-6, gap


# ----- healthy: a mean-teacher target network, detached on purpose and declared in notes --------------


class TeacherStudent(nn.Module):
    def __init__(self, n: Names) -> None:
        super().__init__()
        self.online_name, self.target_name = n.attr("online"), n.attr("target")
        with seeded(13):
            setattr(self, self.online_name, MeshGNN(n))
        with seeded(14):
            setattr(self, self.target_name, MeshGNN(n))

    def forward(self, x, edges, coords):
        pred, kern = getattr(self, self.online_name)(x, edges, coords)
        teacher, _ = getattr(self, self.target_name)(x, edges, coords)
        return pred, kern, teacher.detach()  # the target network follows by averaging (EMA), not gradients


def build_teacher_healthy(n: Names) -> Setup:
    kx, ke, kc, ky = _keys(n)
    tn, ts = _terms(n)

    def step(model, batch):
        pred, kern, teacher = model(batch[kx], batch[ke], batch[kc])
        src, dst = batch[ke]
        return {tn: ((pred - batch[ky]) ** 2).mean(), ts: (kern * (pred[src] - teacher[dst]) ** 2).mean()}

    model = TeacherStudent(n)
    notes = {model.target_name + ".": "mean-teacher target network: updated as an EMA of the online one"}
    return Setup(_spec(n, step, model=model, notes=notes), ["eager"])


def truth_teacher_healthy(n: Names) -> None:
    setup = build_teacher_healthy(n)
    _, ts = _terms(n)
    model, batch = setup.spec.model, setup.spec.batch
    target = getattr(model, model.target_name)
    got = grads(setup.spec.step(model, batch)[ts], dict(target.named_parameters()))
    assert all(is_cut(g) for g in got.values())  # intended: declared in notes
    assert nudge(lambda: setup.spec.step(model, batch)[ts], target.sub("readout").weight) > 1e-9


CASES: list[Case] = [
    *with_twin(
        Case(
            "graph-int32-replay",
            FAMILY,
            "int32",
            "make_fx-replay",
            build=build_int32_replay,
            expect=frozenset({"graph-break-in-model"}),
            node="_to_copy",
            notes="the reference regresses whole counts with a straight-through rounding; the trainer's "
            "cast to the labels' int32 keeps the value and drops the gradient: node reaches nothing",
            file=FILE,
        ),
        build_int32_replay,
        truth_int32_replay,
    ),
    *with_twin(
        Case(
            "graph-float-tau",
            FAMILY,
            "float",
            "reference",
            build=build_float_tau,
            expect=frozenset({"graph-break-in-model"}),
            where="graph-float-tau",
            notes="float(tau) in the step's kernel: smooth depends on log_tau, its gradient never reaches it",
            file=FILE,
        ),
        build_float_tau,
        truth_float_tau,
    ),
    *with_twin(
        Case(
            "graph-item-recompile",
            FAMILY,
            "item-weight",
            "opaque-compiled",
            build=build_item_recompile,
            expect=frozenset({"recompile-per-scenario"}),
            where="graph-item-recompile",
            notes="w[t].item() inside the compiled loss: a Python float per scenario, a guard on its value",
            file=FILE,
        ),
        build_item_recompile,
        truth_item_recompile,
    ),
    *with_twin(
        Case(
            "graph-frozen-tolist",
            FAMILY,
            "tolist",
            "make_fx-replay",
            build=build_frozen_tolist,
            expect=frozenset({"frozen-trace"}),
            where="graph-frozen-tolist",
            node="lift_fresh_copy",
            notes="torch.tensor(kern.tolist()) inside the traced loss: the trace-time kernel is a constant",
            file=FILE,
        ),
        build_frozen_tolist,
        truth_frozen_tolist,
    ),
    Case(
        "graph-teacher-healthy",
        FAMILY,
        "intended-detach",
        "reference",
        build=build_teacher_healthy,
        healthy=True,
        truth=truth_teacher_healthy,
        notes="smooth compares with a detached mean-teacher network, declared in ProbeSpec.notes",
        file=FILE,
    ),
]
