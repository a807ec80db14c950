"""An image denoiser for 1x12x12 patches: a convolutional encoder and decoder. Terms: pixel MSE to
the clean patch and an edge loss (MSE of horizontal and vertical finite differences). The bugs live
only in a user's own trainer path (a plain ``run(batch, weights)``), with no known signature:

- ``denoise-workspace``: the path's fused helper raises a bespoke error when more than one term is
  switched on (the "all" scenario);
- ``denoise-half-features``: the path scales the encoder's output by 0.5 for the edge term (a
  Caffe-style test-time dropout scale left in): no exception, every parameter reached, wrong values.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as nnf

import gradprobe

from . import autograd_of, case, grown, ones_for, params_of, reached, truth, weighted

TERMS = ("pixel", "edge")


class PatchDenoiser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(1, 6, 3, padding=1)
        self.dec = nn.Conv2d(6, 1, 3, padding=1)

    def features(self, noisy: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.enc(noisy))

    def forward(self, noisy: torch.Tensor) -> torch.Tensor:
        return noisy + self.dec(self.features(noisy))


def edges(img: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return img[..., 1:, :] - img[..., :-1, :], img[..., :, 1:] - img[..., :, :-1]


def edge_loss(out: torch.Tensor, clean: torch.Tensor) -> torch.Tensor:
    (oy, ox), (cy, cx) = edges(out), edges(clean)
    return nnf.mse_loss(oy, cy) + nnf.mse_loss(ox, cx)


def patches() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(25)
    yy, xx = torch.meshgrid(torch.arange(12.0), torch.arange(12.0), indexing="ij")
    clean = torch.stack([torch.sin(0.5 * xx + k) * torch.cos(0.3 * yy) for k in range(6)])[:, None].double()
    return {"clean": clean, "noisy": clean + 0.2 * torch.randn(clean.shape, generator=g, dtype=torch.float64)}


def denoise_step(net: PatchDenoiser, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = net(batch["noisy"])
    return {"pixel": nnf.mse_loss(out, batch["clean"]), "edge": edge_loss(out, batch["clean"])}


def _context(net, batch) -> object:
    return type("Ctx", (), {"model": net, "batch": batch})()


# ----- denoise-workspace ----------------------------------------------------------------------------


def reserve_workspace(active_terms: int, slots: int) -> None:
    if active_terms > slots:
        raise RuntimeError("fused kernel: workspace exhausted")  # ROOT denoise-workspace


def fused_trainer(slots: int):
    def builder(ctx):
        net = ctx.model

        def run(batch, weights):
            reserve_workspace(sum(bool(w != 0) for w in weights.values()), slots)
            return weighted(denoise_step(net, batch), weights)

        return run

    return builder


@case(
    "denoise-workspace",
    family="denoise",
    mechanism="bespoke exception in a user path",
    container="opaque-eager",
    expect={"run-failed"},
)
def build_workspace(fixed: bool):
    path = gradprobe.variants.user_variant("fused_trainer", fused_trainer(slots=2 if fixed else 1))
    return (
        grown(26, PatchDenoiser),
        denoise_step,
        patches(),
        {"variants": ["eager", path], "terms": list(TERMS)},
    )


@truth("denoise-workspace")
def check_workspace(fixed: bool) -> None:
    net, _, batch, kw = build_workspace(fixed)
    run = kw["variants"][1].builder(_context(net, batch))
    run(batch, ones_for(TERMS, ["pixel"], torch.float64))  # one term: fine either way
    both = ones_for(TERMS, TERMS, torch.float64)
    if fixed:
        run(batch, both)
    else:
        try:
            run(batch, both)
        except RuntimeError as e:
            assert "workspace exhausted" in str(e)
        else:
            raise AssertionError("the fused path should raise with both terms on")


# ----- denoise-half-features ------------------------------------------------------------------------


def legacy_trainer(half_scale: bool):
    def builder(ctx):
        net = ctx.model

        def run(batch, weights):
            out = net(batch["noisy"])
            feats = net.features(batch["noisy"])
            if half_scale:
                feats = feats * 0.5  # ROOT denoise-half-features
            sharp = batch["noisy"] + net.dec(feats)
            terms = {"pixel": nnf.mse_loss(out, batch["clean"]), "edge": edge_loss(sharp, batch["clean"])}
            return weighted(terms, weights)

        return run

    return builder


@case(
    "denoise-half-features",
    family="denoise",
    mechanism="silent 0.5 scale in a user path",
    container="opaque-eager",
    expect={"flow-mismatch", "gradient-mismatch", "consistency-failed"},
)
def build_half(fixed: bool):
    path = gradprobe.variants.user_variant("legacy_trainer", legacy_trainer(half_scale=not fixed))
    return (
        grown(27, PatchDenoiser),
        denoise_step,
        patches(),
        {"variants": ["eager", path], "terms": list(TERMS)},
    )


@truth("denoise-half-features")
def check_half(fixed: bool) -> None:
    net, step, batch, kw = build_half(fixed)
    run = kw["variants"][1].builder(_context(net, batch))
    only = ones_for(TERMS, ["edge"], torch.float64)
    params = params_of(net)
    mine = autograd_of(run(batch, only)[0], params)
    ref = autograd_of(step(net, batch)["edge"], params)
    assert all(reached(g) for g in mine.values())
    flat_mine = torch.cat([g.flatten() for g in mine.values()])  # type: ignore[union-attr]
    flat_ref = torch.cat([g.flatten() for g in ref.values()])  # type: ignore[union-attr]
    rel = float((flat_mine - flat_ref).norm() / flat_ref.norm())
    if fixed:
        assert rel < 1e-12, rel
    else:
        assert rel > 0.1, rel
