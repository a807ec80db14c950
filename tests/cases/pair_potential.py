"""A neural pair potential: radial-basis pair energies gated by learned species embeddings, a learned
short-range repulsion and per-species reference energies; forces are ``-dE/dpositions`` by autograd.

Not periodic (``box_key=None``). Frames of five atoms of three species, float64. Terms: ``e_loss``
(frame energies) and ``f_loss`` (forces, a second-order term for the parameters).
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
FAMILY = "pair_potential"
FRAMES, ATOMS, SPECIES = 3, 5, 3
DTYPE = torch.float64


class PairPotential(nn.Module):
    """E = sum over pairs of MLP(rbf(r), z_i * z_j) * cutoff(r) + softplus(a) * sum exp(-r / 0.3)."""

    def __init__(self, n: Names, rbf: int = 6, width: int = 8, cutoff: float = 3.0) -> None:
        super().__init__()
        self.names = {base: n.attr(base) for base in ("embed", "pair", "rep", "e0")}
        setattr(self, self.names["embed"], nn.Embedding(SPECIES, 4))
        setattr(
            self, self.names["pair"], nn.Sequential(nn.Linear(rbf + 4, width), nn.Tanh(), nn.Linear(width, 1))
        )
        setattr(self, self.names["rep"], nn.Parameter(torch.tensor([0.3])))
        setattr(self, self.names["e0"], nn.Embedding(SPECIES, 1))
        self.register_buffer("centers", torch.linspace(0.6, cutoff, rbf))
        self.cutoff = cutoff
        self.stale_repulsion = False  # the repulsion reads distances cached before the force pass

    def sub(self, base: str):
        return getattr(self, self.names[base])

    def distances(self, pos: torch.Tensor) -> torch.Tensor:
        diff = pos[:, :, None, :] - pos[:, None, :, :]
        eye = torch.eye(pos.shape[1], dtype=pos.dtype)
        return (diff.pow(2).sum(-1) + eye).sqrt()  # the diagonal is 1, masked below

    def energy_from(self, r: torch.Tensor, r_rep: torch.Tensor, species: torch.Tensor) -> torch.Tensor:
        off = 1.0 - torch.eye(r.shape[-1], dtype=r.dtype)
        z = self.sub("embed")(species)
        rbf = torch.exp(-4.0 * (r[..., None] - self.centers) ** 2)
        fc = 0.5 * (torch.cos(math.pi * r / self.cutoff) + 1.0) * (r < self.cutoff)
        pair = self.sub("pair")(torch.cat([rbf, z[:, :, None] * z[:, None, :]], -1)).squeeze(-1)
        strength = nn.functional.softplus(self.sub("rep"))
        repulsion = strength * torch.exp(-r_rep / 0.3)
        return 0.5 * ((pair * fc + repulsion) * off).sum((1, 2))

    def atom_ref(self, species: torch.Tensor) -> torch.Tensor:
        return self.sub("e0")(species).squeeze(-1).sum(-1)

    def energy(self, pos: torch.Tensor, species: torch.Tensor) -> torch.Tensor:
        r = self.distances(pos)
        return self.energy_from(r, r, species) + self.atom_ref(species)

    def forward(self, pos: torch.Tensor, species: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Interaction energies, reference energies (per frame) and forces."""
        if not pos.requires_grad:
            pos = pos.clone().requires_grad_(True)
        r = self.distances(pos)
        r_rep = r.detach() if self.stale_repulsion else r  # BUG pair-nonconservative
        e = self.energy_from(r, r_rep, species)
        e_sum, train = e.sum(), self.training
        (g,) = torch.autograd.grad(e_sum, pos, create_graph=train, retain_graph=True)
        return e, self.atom_ref(species), -g


def _keys(n: Names) -> tuple[str, str, str, str]:
    return n.key("positions"), n.key("species"), n.key("e_target"), n.key("f_target")


def _batch(n: Names, seed: int) -> dict[str, torch.Tensor]:
    kp, ks, ke, kf = _keys(n)
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor([[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 1]], dtype=DTYPE) * 1.1
    pos = grid + 0.15 * torch.randn(FRAMES, ATOMS, 3, generator=g, dtype=DTYPE)
    species = torch.randint(SPECIES, (FRAMES, ATOMS), generator=g)
    with seeded(100):
        teacher = PairPotential(Names()).to(DTYPE)
    e, e0, f = teacher(pos, species)
    return {kp: pos, ks: species, ke: (e + e0).detach(), kf: f.detach()}


def _model(n: Names) -> PairPotential:
    with seeded(7):
        return PairPotential(n).to(DTYPE)


def _spec(n: Names, model: PairPotential, step, **extra) -> gradprobe.ProbeSpec:
    kp, ks, _, _ = _keys(n)

    def energy_fn(m, batch):
        return m.energy(batch[kp], batch[ks])

    def predict(m, batch):
        return {"force": m(batch[kp], batch[ks])[2]}

    return gradprobe.ProbeSpec(
        model=model,
        step=step,
        batch=_batch(n, 0),
        terms=[n.term("e_loss"), n.term("f_loss")],
        mode="terms",
        energy_fn=energy_fn,
        predict=predict,
        coord_key=kp,
        box_key=None,
        name=FAMILY,
        **extra,
    )


def _step(n: Names):
    kp, ks, ke, kf = _keys(n)
    te, tf = n.term("e_loss"), n.term("f_loss")

    def step(model, batch):
        e, e0, f = model(batch[kp], batch[ks])
        e = e + e0
        return {te: ((e - batch[ke]) ** 2).mean(), tf: ((f - batch[kf]) ** 2).mean()}

    return step


def _terms(n: Names) -> list[str]:
    return [n.term("e_loss"), n.term("f_loss")]


# ----- pair-makefx-detach: the trainer replays a make_fx trace of its force loss ----------------------


def build_makefx_detach(n: Names, bug: bool) -> Setup:
    kp, ks, ke, kf = _keys(n)
    te, tf = _terms(n)
    model = _model(n)

    def make_run(ctx):
        m = ctx.model
        params, buffers = dict(m.named_parameters()), dict(m.named_buffers())

        def losses(p, b, batch, w):
            e, e0, f = functional_call(m, {**p, **b}, (batch[kp], batch[ks]))
            e = e + e0
            terms = {te: ((e - batch[ke]) ** 2).mean(), tf: ((f - batch[kf]) ** 2).mean()}
            return weighted_total(terms, w), terms

        alias = {torch.ops.aten.detach.default: torch.ops.aten.alias.default}
        table = None if bug else alias  # BUG pair-makefx-detach
        example = term_weights([te, tf], [te, tf], next(iter(params.values())))
        gm = make_fx(losses, decomposition_table=table)(params, buffers, ctx.batch, example)

        def run(batch, weights):
            return gm(params, buffers, batch, {t: weights[t] for t in (te, tf)})

        return run

    return Setup(_spec(n, model, _step(n)), ["eager", opaque(n.variant("replay"), make_run)])


def truth_makefx_detach(n: Names, bug: bool) -> None:
    setup = build_makefx_detach(n, bug)
    te, tf = _terms(n)
    model, batch = setup.spec.model, setup.spec.batch
    params = dict(model.named_parameters())
    only_f = term_weights([te, tf], [tf], next(model.parameters()))
    value = user_run(setup)(batch, only_f)[1][tf]
    eager_value = setup.spec.step(model, batch)[tf]
    torch.testing.assert_close(value, eager_value)  # same value: only the double backward differs
    replay, eager = grads(value, params), grads(eager_value, params)
    wrong = [
        k
        for k, g in eager.items()
        if g is not None and float((replay[k] - g).norm()) > 1e-3 * float(g.norm())  # type: ignore[operator]
    ]
    # The recorded detach nodes drop the part of d(f_loss)/d(theta) that flows through the saved tanh
    # outputs: the pair MLP's first layer and the species embedding get wrong gradients.
    assert bool(wrong) == bug, wrong


# ----- pair-eval-forces: the trainer switches to eval mode "for deterministic forces" ---------------


def build_eval_forces(n: Names, bug: bool) -> Setup:
    kp, ks, ke, kf = _keys(n)
    te, tf = _terms(n)
    model = _model(n)

    def make_run(ctx):
        m = ctx.model

        def losses(e, f, batch, w):
            terms = {te: ((e - batch[ke]) ** 2).mean(), tf: ((f - batch[kf]) ** 2).mean()}
            return weighted_total(terms, w), terms

        compiled = torch.compile(fresh(losses), backend="eager")

        def run(batch, weights):
            was = m.training
            # no dropout here anyway; "deterministic forces". The root line the finding names:
            m.eval() if bug else m.train()  # BUG pair-eval-forces
            try:
                e, e0, f = m(batch[kp], batch[ks])
            finally:
                m.train(was)
            return compiled(e + e0, f, batch, {t: weights[t] for t in (te, tf)})

        return run

    return Setup(_spec(n, model, _step(n)), ["eager", opaque(n.variant("trainer"), make_run)])


def truth_eval_forces(n: Names, bug: bool) -> None:
    setup = build_eval_forces(n, bug)
    te, tf = _terms(n)
    model, batch = setup.spec.model, setup.spec.batch
    run = user_run(setup)
    only_f = term_weights([te, tf], [tf], next(model.parameters()))
    value = run(batch, only_f)[1][tf]
    got = grads(value, dict(model.named_parameters()))
    pair = dict(model.named_parameters())[model.names["pair"] + ".0.weight"]
    if bug:
        assert all(is_cut(g) for g in got.values()), "eval-mode forces must be detached"
        assert nudge(lambda: run(batch, only_f)[1][tf], pair) > 1e-9
    else:
        assert not is_cut(got[model.names["pair"] + ".0.weight"])
    assert model.training


# ----- pair-peratom-norm: the trainer's energy loss is per atom, the reference's per frame -----------


def build_peratom_norm(n: Names, bug: bool) -> Setup:
    kp, ks, ke, kf = _keys(n)
    te, tf = _terms(n)
    model = _model(n)

    def make_run(ctx):
        m = ctx.model

        def losses(e, f, batch, w):
            scale = batch[kp].shape[1] if bug else 1  # BUG pair-peratom-norm
            terms = {te: (((e - batch[ke]) / scale) ** 2).mean(), tf: ((f - batch[kf]) ** 2).mean()}
            return weighted_total(terms, w), terms

        compiled = torch.compile(fresh(losses), backend="eager")

        def run(batch, weights):
            e, e0, f = m(batch[kp], batch[ks])
            return compiled(e + e0, f, batch, {t: weights[t] for t in (te, tf)})

        return run

    return Setup(_spec(n, model, _step(n)), ["eager", opaque(n.variant("trainer"), make_run)])


def truth_peratom_norm(n: Names, bug: bool) -> None:
    setup = build_peratom_norm(n, bug)
    te, tf = _terms(n)
    model, batch = setup.spec.model, setup.spec.batch
    params = dict(model.named_parameters())
    only_e = term_weights([te, tf], [te], next(model.parameters()))
    mine = user_run(setup)(batch, only_e)[1][te]
    ref = setup.spec.step(model, batch)[te]
    factor = ATOMS**2 if bug else 1
    torch.testing.assert_close(ref / factor, mine)
    for k, g in grads(mine, params).items():
        g_ref = grads(ref, params)[k]
        if g_ref is not None:
            torch.testing.assert_close(g_ref / factor, g, msg=k)


# ----- pair-nonconservative: the force pass reads a stale (detached) distance for the repulsion ------


def build_nonconservative(n: Names, bug: bool) -> Setup:
    model = _model(n)
    model.stale_repulsion = bug
    return Setup(_spec(n, model, _step(n)), ["eager"], checks=("physics",))


def truth_nonconservative(n: Names, bug: bool) -> None:
    setup = build_nonconservative(n, bug)
    kp, ks, _, _ = _keys(n)
    model, batch = setup.spec.model, setup.spec.batch
    pos = batch[kp].clone().requires_grad_(True)
    (g,) = torch.autograd.grad(model.energy(pos, batch[ks]).sum(), pos)
    force = setup.spec.predict(model, batch)["force"].detach()
    gap = float((force + g).abs().max())
    assert (gap > 1e-3) if bug else (gap < 1e-10), gap


# ----- pair-numpy-shift: the step adds the reference energies through numpy ---------------------------


def build_numpy_shift(n: Names, bug: bool) -> Setup:
    kp, ks, ke, kf = _keys(n)
    te, tf = _terms(n)

    def step(model, batch):
        e, e0, f = model(batch[kp], batch[ks])
        e0 = torch.from_numpy(e0.detach().numpy()) if bug else e0  # BUG pair-numpy-shift
        e = e + e0
        return {te: ((e - batch[ke]) ** 2).mean(), tf: ((f - batch[kf]) ** 2).mean()}

    return Setup(_spec(n, _model(n), step), ["eager"])


def truth_numpy_shift(n: Names, bug: bool) -> None:
    setup = build_numpy_shift(n, bug)
    te, _ = _terms(n)
    model, batch = setup.spec.model, setup.spec.batch
    ref_w = model.sub("e0").weight
    g = grads(setup.spec.step(model, batch)[te], {"e0": ref_w})["e0"]
    if bug:
        assert is_cut(g)
        assert nudge(lambda: setup.spec.step(model, batch)[te], ref_w) > 1e-9
    else:
        assert not is_cut(g)


CASES: list[Case] = [
    *with_twin(
        Case(
            "pair-makefx-detach",
            FAMILY,
            "makefx-detach",
            "make_fx-replay",
            build=build_makefx_detach,
            expect=frozenset({"makefx-detach"}),
            node="detach",
            notes="make_fx of the force loss (autograd.grad create_graph=True inside) records aten.detach on "
            "saved tensors; the twin decomposes detach to alias",
            file=FILE,
        ),
        build_makefx_detach,
        truth_makefx_detach,
    ),
    *with_twin(
        Case(
            "pair-eval-forces",
            FAMILY,
            "eval-mode",
            "opaque-compiled",
            build=build_eval_forces,
            expect=frozenset({"trace-eval-mode"}),
            where="pair-eval-forces",
            notes="the trainer runs the model in eval mode, so create_graph=self.training is False",
            file=FILE,
        ),
        build_eval_forces,
        truth_eval_forces,
    ),
    *with_twin(
        Case(
            "pair-peratom-norm",
            FAMILY,
            "norm-per-atom",
            "opaque-compiled",
            build=build_peratom_norm,
            expect=frozenset({"norm-mismatch"}),
            notes="the trainer's energy loss divides the residual by the atom count (factor 1/25)",
            file=FILE,
        ),
        build_peratom_norm,
        truth_peratom_norm,
    ),
    *with_twin(
        Case(
            "pair-nonconservative",
            FAMILY,
            "detached-distance",
            "reference",
            build=build_nonconservative,
            expect=frozenset({"forces-not-conservative"}),
            notes="the force pass computes the repulsion from a detached distance: forces miss its part",
            file=FILE,
        ),
        build_nonconservative,
        truth_nonconservative,
    ),
    *with_twin(
        Case(
            "pair-numpy-shift",
            FAMILY,
            "numpy",
            "reference",
            build=build_numpy_shift,
            expect=frozenset({"graph-break-in-model"}),
            where="pair-numpy-shift",
            notes="the reference energies go through numpy: e_loss never reaches the e0 embedding",
            file=FILE,
        ),
        build_numpy_shift,
        truth_numpy_shift,
    ),
]
