"""Representation probing and distillation on spectra (64 bins):

- ``ae-linear-probe`` (intended): an autoencoder trained by reconstruction, and a linear probe that
  reads the code through ``.detach()`` to measure what the code holds without shaping it.
- ``spectra-backbone-detached`` (bug): a fine-tuning step whose only term reads the backbone's
  features through ``.detach()`` (copied from the probe code): nothing else reaches the backbone, so
  this explicit stop-gradient is an error, not a question. Twin: no detach.
- ``distill-declared-teacher`` (declared): a student distilled from a teacher that sits in the same
  module; the teacher's logits are computed under ``torch.no_grad()`` and nothing trains the teacher
  here. The spec's ``notes`` declare it: no error.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as nnf

from . import autograd_of, case, grown, moves, params_of, reached, truth

BINS, CODE, CLASSES = 64, 6, 4


def spectra() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(13)
    grid = torch.linspace(0, 1, BINS, dtype=torch.float64)
    centre = torch.rand(30, 1, generator=g, dtype=torch.float64)
    width = 0.05 + 0.1 * torch.rand(30, 1, generator=g, dtype=torch.float64)
    peaks = torch.exp(-(((grid - centre) / width) ** 2)) + 0.02 * torch.randn(
        30, BINS, generator=g, dtype=torch.float64
    )
    return {"spectrum": peaks, "phase": (centre.squeeze(1) * CLASSES).long().clamp(max=CLASSES - 1)}


# ----- ae-linear-probe --------------------------------------------------------------------------------


class ProbedAutoencoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Sequential(nn.Linear(BINS, 24), nn.ELU(), nn.Linear(24, CODE))
        self.decode = nn.Sequential(nn.Linear(CODE, 24), nn.ELU(), nn.Linear(24, BINS))
        self.readout = nn.Linear(CODE, CLASSES)


def probe_step(ae: ProbedAutoencoder, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    code = ae.encode(batch["spectrum"])
    recon = nnf.mse_loss(ae.decode(code), batch["spectrum"])
    probe_logits = ae.readout(code.detach())  # STOP ae-linear-probe
    return {"recon": recon, "probe_ce": nnf.cross_entropy(probe_logits, batch["phase"])}


@case("ae-linear-probe", family="probing", mechanism="detach (linear probe)", intended=True)
def build_probe(fixed: bool):
    return grown(14, ProbedAutoencoder), probe_step, spectra(), {}


@truth("ae-linear-probe")
def check_probe(fixed: bool) -> None:
    ae, step, batch, _ = build_probe(fixed)
    params = params_of(ae)
    probe_grads = autograd_of(step(ae, batch)["probe_ce"], params)
    recon_grads = autograd_of(step(ae, batch)["recon"], params)
    assert probe_grads["encode.0.weight"] is None and reached(probe_grads["readout.weight"])
    assert moves(lambda: step(ae, batch)["probe_ce"], params["encode.0.weight"]) > 1e-9
    assert all(reached(recon_grads[k]) for k in params if k.startswith("encode."))


# ----- spectra-backbone-detached -----------------------------------------------------------------------


class PhaseClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(BINS, 24), nn.ELU(), nn.Linear(24, CODE))
        self.head = nn.Linear(CODE, CLASSES)


def finetune_step(net: PhaseClassifier, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    feats = net.backbone(batch["spectrum"])
    return {"phase_ce": nnf.cross_entropy(net.head(feats), batch["phase"])}


def finetune_step_detached(net: PhaseClassifier, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    feats = net.backbone(batch["spectrum"]).detach()  # ROOT spectra-backbone-detached
    return {"phase_ce": nnf.cross_entropy(net.head(feats), batch["phase"])}


@case(
    "spectra-backbone-detached",
    family="probing",
    mechanism="detach that leaves parameters reached by no term",
    expect={"graph-break-in-model"},
)
def build_finetune(fixed: bool):
    return grown(32, PhaseClassifier), finetune_step if fixed else finetune_step_detached, spectra(), {}


@truth("spectra-backbone-detached")
def check_finetune(fixed: bool) -> None:
    net, step, batch, _ = build_finetune(fixed)
    params = params_of(net)
    grads = autograd_of(step(net, batch)["phase_ce"], params)
    assert reached(grads["head.weight"])
    if fixed:
        assert reached(grads["backbone.0.weight"])
    else:
        assert grads["backbone.0.weight"] is None
        assert moves(lambda: step(net, batch)["phase_ce"], params["backbone.0.weight"]) > 1e-9


# ----- distill-declared-teacher -----------------------------------------------------------------------


class TeacherStudent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.teacher = nn.Sequential(nn.Linear(BINS, 48), nn.ReLU(), nn.Linear(48, CLASSES))
        self.student = nn.Sequential(nn.Linear(BINS, 8), nn.ReLU(), nn.Linear(8, CLASSES))


TEMPERATURE = 2.0


def distill_step(pair: TeacherStudent, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    with torch.no_grad():  # STOP distill-declared-teacher
        teacher_logits = pair.teacher(batch["spectrum"])  # STOP distill-declared-teacher
        soft = nnf.softmax(teacher_logits / TEMPERATURE, dim=-1)  # STOP distill-declared-teacher
    student = pair.student(batch["spectrum"])
    kl = nnf.kl_div(nnf.log_softmax(student / TEMPERATURE, dim=-1), soft, reduction="batchmean")
    return {"distill": TEMPERATURE**2 * kl, "label_ce": nnf.cross_entropy(student, batch["phase"])}


@case(
    "distill-declared-teacher",
    family="probing",
    mechanism="no_grad (teacher), declared in notes",
    intended=True,
)
def build_distill(fixed: bool):
    notes = {"teacher": "pretrained teacher, frozen by design: its logits are targets"}
    return grown(15, TeacherStudent), distill_step, spectra(), {"notes": notes}


@truth("distill-declared-teacher")
def check_distill(fixed: bool) -> None:
    pair, step, batch, _ = build_distill(fixed)
    params = params_of(pair)
    grads = autograd_of(step(pair, batch)["distill"], params)
    # The teacher is cut from every term, the student is reached.
    assert all(grads[k] is None for k in params if k.startswith("teacher."))
    assert all(reached(grads[k]) for k in params if k.startswith("student."))
    assert moves(lambda: step(pair, batch)["distill"], params["teacher.2.weight"]) > 1e-9
