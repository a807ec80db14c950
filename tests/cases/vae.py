"""A small MLP variational auto-encoder on 12-pixel images; the sampling noise comes with the batch.

Terms: ``recon`` (squared error of the decoded image, summed over pixels, mean over the batch) and
``kl`` (KL divergence of the posterior from the unit Gaussian). float64.
"""

from __future__ import annotations

import contextlib

import numpy as np
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
FAMILY = "vae"
BATCH, PIXELS, LATENT, HIDDEN = 8, 12, 3, 16
DTYPE = torch.float64


class VAE(nn.Module):
    def __init__(self, n: Names) -> None:
        super().__init__()
        self.names = {base: n.attr(base) for base in ("enc", "mu", "logvar", "dec")}
        setattr(self, self.names["enc"], nn.Sequential(nn.Linear(PIXELS, HIDDEN), nn.Tanh()))
        setattr(self, self.names["mu"], nn.Linear(HIDDEN, LATENT))
        setattr(self, self.names["logvar"], nn.Linear(HIDDEN, LATENT))
        dec = nn.Sequential(nn.Linear(LATENT, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, PIXELS))
        setattr(self, self.names["dec"], dec)

    def sub(self, base: str) -> nn.Module:
        return getattr(self, self.names[base])

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.sub("enc")(x)
        return self.sub("mu")(h), self.sub("logvar")(h)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.sub("dec")(z)

    def forward(self, x: torch.Tensor, eps: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mu, logvar = self.encode(x)
        z = mu + torch.exp(0.5 * logvar) * eps
        return self.decode(z), mu, logvar


def _keys(n: Names) -> tuple[str, str]:
    return n.key("pixels"), n.key("noise")


def _terms(n: Names) -> tuple[str, str]:
    return n.term("recon"), n.term("kl")


def _batch(n: Names, seed: int) -> dict[str, torch.Tensor]:
    kx, ke = _keys(n)
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(BATCH, PIXELS, generator=g, dtype=DTYPE)
    return {kx: x, ke: torch.randn(BATCH, LATENT, generator=g, dtype=DTYPE)}


def _model(n: Names) -> VAE:
    with seeded(11):
        return VAE(n).to(DTYPE)


def kl_of(mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    return (-0.5 * (1 + logvar - mu**2 - logvar.exp()).sum(-1)).mean()


def straight_through_8bit(p: torch.Tensor) -> torch.Tensor:
    """The value of round(p), the gradient of p."""
    return p + (p.round() - p).detach()


def _step(n: Names, quantized: bool = False):
    kx, ke = _keys(n)
    tr, tk = _terms(n)

    def step(model, batch):
        logits, mu, logvar = model(batch[kx], batch[ke])
        x_hat = torch.sigmoid(logits)
        if quantized:
            x_hat = straight_through_8bit(x_hat * 255) / 255
        return {tr: ((x_hat - batch[kx]) ** 2).sum(-1).mean(), tk: kl_of(mu, logvar)}

    return step


def _spec(n: Names, step, second: bool = False) -> gradprobe.ProbeSpec:
    return gradprobe.ProbeSpec(
        model=_model(n),
        step=step,
        batch=_batch(n, 0),
        second_batch=_batch(n, 1) if second else None,
        terms=list(_terms(n)),
        mode="terms",
        name=FAMILY,
    )


def _weights(weights, names) -> dict[str, torch.Tensor]:
    return {t: weights[t] for t in names}


def _check_cut(setup: Setup, term: str, parts: tuple[str, ...], bug: bool) -> None:
    """The trainer's ``term`` reaches no parameter of ``parts`` (and its value moves with them) iff bug."""
    model, batch = setup.spec.model, setup.spec.batch
    run = user_run(setup)
    only = term_weights(_terms_of(setup), [term], next(model.parameters()))
    value = run(batch, only)[1][term]
    torch.testing.assert_close(value, setup.spec.step(model, batch)[term])
    got = grads(value, dict(model.named_parameters()))
    for part in parts:
        mine = {k: g for k, g in got.items() if k.startswith(model.names[part] + ".")}
        if bug:
            assert all(is_cut(g) for g in mine.values()), (part, mine)
        else:
            assert not any(is_cut(g) for g in mine.values()), (part, mine)
    if bug:  # after the gradients: moving a parameter in place invalidates the graph's saved tensors
        for part in parts:
            weight = model.sub(part)[0].weight if part in ("enc", "dec") else model.sub(part).weight
            assert nudge(lambda: run(batch, only)[1][term], weight) > 1e-9, part


def _terms_of(setup: Setup) -> list[str]:
    assert setup.spec.terms is not None
    return list(setup.spec.terms)


# ----- vae-detach-z: the trainer decodes a detached sample (a two-stage recipe left on) ---------------


def build_detach_z(n: Names, bug: bool) -> Setup:
    kx, ke = _keys(n)
    tr, tk = _terms(n)

    def make_run(ctx):
        m = ctx.model

        def losses(batch, w):
            mu, logvar = m.encode(batch[kx])
            z = mu + torch.exp(0.5 * logvar) * batch[ke]
            z = z.detach() if bug else z  # BUG vae-detach-z
            x_hat = torch.sigmoid(m.decode(z))
            terms = {tr: ((x_hat - batch[kx]) ** 2).sum(-1).mean(), tk: kl_of(mu, logvar)}
            return weighted_total(terms, w), terms

        compiled = torch.compile(fresh(losses), backend="aot_eager")
        return lambda batch, weights: compiled(batch, _weights(weights, (tr, tk)))

    return Setup(_spec(n, _step(n)), ["eager", opaque(n.variant("trainer"), make_run)])


def truth_detach_z(n: Names, bug: bool) -> None:
    setup = build_detach_z(n, bug)
    _check_cut(setup, n.term("recon"), ("enc", "mu", "logvar"), bug)


# ----- vae-quantize-long: the trainer's 8-bit output is an integer cast, not the straight-through one -


def build_quantize_long(n: Names, bug: bool) -> Setup:
    kx, ke = _keys(n)
    tr, tk = _terms(n)

    def make_run(ctx):
        m = ctx.model

        def losses(batch, w):
            logits, mu, logvar = m(batch[kx], batch[ke])
            p = torch.sigmoid(logits) * 255
            q = p.round().long().to(p.dtype) if bug else straight_through_8bit(p)  # BUG vae-quantize-long
            terms = {tr: ((q / 255 - batch[kx]) ** 2).sum(-1).mean(), tk: kl_of(mu, logvar)}
            return weighted_total(terms, w), terms

        compiled = torch.compile(fresh(losses), backend="aot_eager")
        return lambda batch, weights: compiled(batch, _weights(weights, (tr, tk)))

    return Setup(_spec(n, _step(n, quantized=True)), ["eager", opaque(n.variant("trainer"), make_run)])


def truth_quantize_long(n: Names, bug: bool) -> None:
    setup = build_quantize_long(n, bug)
    model, batch = setup.spec.model, setup.spec.batch
    tr = n.term("recon")
    run = user_run(setup)
    only = term_weights(_terms_of(setup), [tr], next(model.parameters()))
    value = run(batch, only)[1][tr]
    torch.testing.assert_close(value, setup.spec.step(model, batch)[tr])
    got = grads(value, dict(model.named_parameters()))
    if bug:
        assert all(is_cut(g) for g in got.values()), got
        # 255 levels: a 1e-2 move of the decoder's output bias crosses some of them.
        out_bias = model.sub("dec")[2].bias
        assert nudge(lambda: run(batch, only)[1][tr], out_bias, eps=1e-2) > 1e-6
    else:
        assert not any(is_cut(g) for g in got.values()), got


# ----- make_fx replays: the trainer's loss is a module, traced once and replayed ----------------------


class _TrainerLoss(nn.Module):
    """A trainer's loss module. make_fx keeps stack traces only for frames named ``forward``, so the
    bug lines that must show up in the trace's stack traces are in ``forward`` methods."""

    def __init__(self, model: VAE, n: Names, bug: bool) -> None:
        super().__init__()
        self.model, self.bug = model, bug
        self.kx, self.ke = _keys(n)
        self.tr, self.tk = _terms(n)

    def outputs(self, p, b, batch):
        return functional_call(self.model, {**p, **b}, (batch[self.kx], batch[self.ke]))

    def finish(self, x_hat, mu, logvar, batch, w):
        terms = {self.tr: ((x_hat - batch[self.kx]) ** 2).sum(-1).mean(), self.tk: kl_of(mu, logvar)}
        return weighted_total(terms, w), terms


def _replay(n: Names, loss_cls: type[_TrainerLoss], bug: bool, **trace):
    """make_run of a trainer that traces ``loss_cls`` with make_fx once and replays the graph."""
    names = _terms(n)

    def make_run(ctx):
        params, buffers = dict(ctx.model.named_parameters()), dict(ctx.model.named_buffers())
        example = term_weights(names, names, next(iter(params.values())))
        gm = make_fx(loss_cls(ctx.model, n, bug), **trace)(params, buffers, ctx.batch, example)
        return lambda batch, weights: gm(params, buffers, batch, _weights(weights, names))

    return make_run


# ----- vae-data-replay: the trainer's traced KL reads logvar.data ------------------------------------


class DataKL(_TrainerLoss):
    def forward(self, p, b, batch, w):
        logits, mu, logvar = self.outputs(p, b, batch)
        lv = logvar.data if self.bug else logvar  # BUG vae-data-replay
        return self.finish(torch.sigmoid(logits), mu, lv, batch, w)


def build_data_replay(n: Names, bug: bool) -> Setup:
    make_run = _replay(n, DataKL, bug, record_stack_traces=True)
    return Setup(_spec(n, _step(n)), ["eager", opaque(n.variant("replay"), make_run)])


def truth_data_replay(n: Names, bug: bool) -> None:
    _check_cut(build_data_replay(n, bug), n.term("kl"), ("logvar",), bug)


# ----- vae-nograd-replay: the decoded image is computed under no_grad (copied from the metrics code) --


class NoGradRecon(_TrainerLoss):
    def forward(self, p, b, batch, w):
        logits, mu, logvar = self.outputs(p, b, batch)
        with torch.no_grad() if self.bug else contextlib.nullcontext():
            x_hat = torch.sigmoid(logits)  # BUG vae-nograd-replay
        return self.finish(x_hat, mu, logvar, batch, w)


def build_nograd_replay(n: Names, bug: bool) -> Setup:
    make_run = _replay(n, NoGradRecon, bug, pre_dispatch=True, record_stack_traces=True)
    return Setup(_spec(n, _step(n)), ["eager", opaque(n.variant("replay"), make_run)])


def truth_nograd_replay(n: Names, bug: bool) -> None:
    setup = build_nograd_replay(n, bug)
    _check_cut(setup, n.term("recon"), ("enc", "mu", "logvar", "dec"), bug)


# ----- vae-frozen-numpy: the traced KL clips logvar with numpy: a trace-time constant ----------------


class NumpyClipKL(_TrainerLoss):
    def forward(self, p, b, batch, w):
        logits, mu, logvar = self.outputs(p, b, batch)
        if self.bug:
            lv = torch.from_numpy(np.clip(logvar.detach().numpy(), -6.0, 6.0))  # BUG vae-frozen-numpy
        else:
            lv = logvar.clamp(-6.0, 6.0)
        return self.finish(torch.sigmoid(logits), mu, lv, batch, w)


def build_frozen_numpy(n: Names, bug: bool) -> Setup:
    make_run = _replay(n, NumpyClipKL, bug)  # no stack traces: only the graph node names the place
    return Setup(_spec(n, _step(n), second=True), ["eager", opaque(n.variant("replay"), make_run)])


def truth_frozen_numpy(n: Names, bug: bool) -> None:
    setup = build_frozen_numpy(n, bug)
    model, batch, other = setup.spec.model, setup.spec.batch, setup.spec.second_batch
    tk = n.term("kl")
    run = user_run(setup)
    only = term_weights(_terms_of(setup), [tk], next(model.parameters()))
    value = run(batch, only)[1][tk]
    torch.testing.assert_close(value, setup.spec.step(model, batch)[tk])  # same value on the traced batch
    logvar = {k: p for k, p in model.named_parameters() if k.startswith(model.names["logvar"] + ".")}
    got = grads(value, logvar)
    gap = abs(float((run(other, only)[1][tk] - setup.spec.step(model, other)[tk]).detach()))
    if bug:
        assert all(is_cut(g) for g in got.values()), got
        assert gap > 1e-6, gap  # the second batch's KL uses the first batch's logvar
    else:
        assert not any(is_cut(g) for g in got.values()), got
        assert gap < 1e-12, gap


CASES: list[Case] = [
    *with_twin(
        Case(
            "vae-detach-z",
            FAMILY,
            "detach",
            "opaque-compiled",
            build=build_detach_z,
            expect=frozenset({"graph-break-in-model"}),
            where="vae-detach-z",
            notes="recon reaches no encoder parameter (kl still does): the trainer decodes z.detach()",
            file=FILE,
        ),
        build_detach_z,
        truth_detach_z,
    ),
    *with_twin(
        Case(
            "vae-quantize-long",
            FAMILY,
            "long",
            "opaque-compiled",
            build=build_quantize_long,
            expect=frozenset({"graph-break-in-model"}),
            where="vae-quantize-long",
            notes="the reference trains on 8-bit outputs with a straight-through estimator; the trainer's "
            "`.long()` gives the same value and no gradient: recon reaches nothing",
            file=FILE,
        ),
        build_quantize_long,
        truth_quantize_long,
    ),
    *with_twin(
        Case(
            "vae-data-replay",
            FAMILY,
            "data",
            "make_fx-replay",
            build=build_data_replay,
            expect=frozenset({"graph-break-in-model"}),
            where="vae-data-replay",
            node="detach",
            notes="make_fx records logvar.data as aten.detach: kl reaches no logvar-head parameter",
            file=FILE,
        ),
        build_data_replay,
        truth_data_replay,
    ),
    *with_twin(
        Case(
            "vae-nograd-replay",
            FAMILY,
            "no_grad",
            "make_fx-replay",
            build=build_nograd_replay,
            expect=frozenset({"graph-break-in-model"}),
            where="vae-nograd-replay",
            notes="traced with pre_dispatch=True, so the no_grad block is recorded (_set_grad_enabled): "
            "recon has no gradient at all",
            file=FILE,
        ),
        build_nograd_replay,
        truth_nograd_replay,
    ),
    *with_twin(
        Case(
            "vae-frozen-numpy",
            FAMILY,
            "numpy",
            "make_fx-replay",
            build=build_frozen_numpy,
            expect=frozenset({"frozen-trace"}),
            node="lift_fresh_copy",
            notes="np.clip of logvar inside the traced loss: the trace-time logvar becomes a constant",
            file=FILE,
        ),
        build_frozen_numpy,
        truth_frozen_numpy,
    ),
]
