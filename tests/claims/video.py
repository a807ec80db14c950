"""Action recognition on short clips: a per-frame encoder, the frame features stacked into a
preallocated ``(clip, frames, features)`` tensor with ``torch.stack(..., out=...)``, and a temporal
head over the stack. Terms: the clip's action cross-entropy, and a per-frame auxiliary loss (frame
features predict the frame's motion energy) that reaches the frame encoder directly.

Bug ``clip-stack-out``: ``torch.stack(..., out=buffer)`` refuses inputs that require grad, so the
step runs it under ``torch.no_grad()``: the action term keeps its value but its gradient no longer
reaches the frame encoder, while the auxiliary term still trains the encoder. Written with an explicit
stop-gradient construct, and worked around by the step, it is structurally what an intended one looks
like (a probe on detached features): the tool cannot know, so it asks — a ``stop-gradient`` warning at
the ``with`` block's op (issue 32's policy). Twin: ``torch.stack`` without ``out=``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as nnf

from . import autograd_of, case, grown, moves, params_of, reached, truth

FRAMES, PIXELS, FEATS, ACTIONS = 5, 16, 6, 3


class ClipNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frame_encoder = nn.Sequential(nn.Linear(PIXELS, 20), nn.Hardswish(), nn.Linear(20, FEATS))
        self.motion = nn.Linear(FEATS, 1)
        self.temporal = nn.Conv1d(FEATS, 8, kernel_size=3, padding=1)
        self.action = nn.Linear(8, ACTIONS)


def clips() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(33)
    video = torch.randn(6, FRAMES, PIXELS, generator=g, dtype=torch.float64).cumsum(dim=1)
    return {
        "video": video,
        "label": torch.tensor([0, 1, 2, 0, 1, 2]),
        "motion_energy": video.diff(dim=1, prepend=video[:, :1]).pow(2).mean(-1),
    }


def clip_losses(net: ClipNet, batch: dict[str, torch.Tensor], preallocate: bool) -> dict[str, torch.Tensor]:
    video = batch["video"]
    per_frame = [net.frame_encoder(video[:, t]) for t in range(FRAMES)]
    if preallocate:
        stacked = video.new_empty(video.shape[0], FRAMES, FEATS)
        with torch.no_grad():
            torch.stack(per_frame, dim=1, out=stacked)  # ROOT clip-stack-out
    else:
        stacked = torch.stack(per_frame, dim=1)
    pooled = net.temporal(stacked.transpose(1, 2)).amax(dim=-1)
    motion = net.motion(torch.stack(per_frame, dim=1)).squeeze(-1)
    return {
        "action_ce": nnf.cross_entropy(net.action(torch.relu(pooled)), batch["label"]),
        "motion_aux": nnf.mse_loss(motion, batch["motion_energy"]),
    }


def clip_step(net: ClipNet, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return clip_losses(net, batch, preallocate=False)


def clip_step_preallocated(net: ClipNet, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return clip_losses(net, batch, preallocate=True)


@case(
    "clip-stack-out",
    family="video",
    mechanism="torch.stack(out=) under no_grad",
    expect={"stop-gradient"},
    severity="warning",
)
def build(fixed: bool):
    return grown(34, ClipNet), clip_step if fixed else clip_step_preallocated, clips(), {}


@truth("clip-stack-out")
def check(fixed: bool) -> None:
    net, step, batch, _ = build(fixed)
    params = params_of(net)
    grads = autograd_of(step(net, batch)["action_ce"], params)
    assert reached(grads["action.weight"]) and reached(grads["temporal.weight"])
    aux = autograd_of(step(net, batch)["motion_aux"], params)
    assert reached(aux["frame_encoder.0.weight"])  # the step still reaches the encoder, bug or not
    if fixed:
        assert reached(grads["frame_encoder.0.weight"])
    else:
        assert grads["frame_encoder.0.weight"] is None
        assert moves(lambda: step(net, batch)["action_ce"], params["frame_encoder.0.weight"]) > 1e-9
