"""A model with reentrant activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``,
the old default, still common) refuses ``autograd.grad`` and ``backward(inputs=...)``: before, every
eager run of a correct model failed ("run-failed ... cause not known"). It is measured with a plain
``backward()`` into ``.grad``, read and put back, with the same statuses as the non-reentrant twin;
the classic bug of that construct (no input of the checkpointed block requires grad, so its
parameters get no gradient) is still found.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradprobe
from gradprobe.claims import audit


class Encoder(nn.Module):
    def __init__(self, reentrant: bool, frozen_embedding: bool = False) -> None:
        super().__init__()
        self.reentrant, self.frozen_embedding = reentrant, frozen_embedding
        self.embed = nn.Embedding(25, 10)
        self.block = nn.Sequential(nn.Linear(10, 10), nn.SiLU(), nn.Linear(10, 10))
        self.classify = nn.Linear(10, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        if self.frozen_embedding:
            h = h.detach()  # the embedding kept fixed: then nothing entering the block requires grad
        return self.classify(checkpoint(self.block, h, use_reentrant=self.reentrant))


def losses(m: Encoder, b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    logits = m(b["tokens"])
    return {"ce": nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten()),
            "reg": 1e-3 * m.classify.weight.square().sum()}  # fmt: skip


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "tokens": torch.randint(0, 25, (4, 6), generator=g),
        "labels": torch.randint(0, 3, (4, 6), generator=g),
    }


def _probe(model: Encoder, **kwargs) -> gradprobe.FlowMap:  # type: ignore[no-untyped-def]
    return gradprobe.probe(model, losses, batch(), progress=False, **kwargs)


@pytest.mark.parametrize("checks", [(), ("gradients", "balance", "training")])
def test_a_reentrant_checkpoint_is_measured_like_a_non_reentrant_one(checks) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    plain = Encoder(reentrant=False)
    reentrant = Encoder(reentrant=True)
    reentrant.load_state_dict(plain.state_dict())
    grad = torch.ones_like(reentrant.block[0].weight)
    reentrant.block[0].weight.grad = grad  # the user's .grad: the same object after the probe
    got, want = _probe(reentrant, checks=list(checks)), _probe(plain, checks=list(checks))
    assert not got.errors(), gradprobe.render(got)
    for s in got.scenario_names:
        assert got.count("eager", s) == want.count("eager", s) == ((7, 7) if s != "reg only" else (1, 7))
        for p in got.trainable:
            a, b = got.cell("eager", s, p), want.cell("eager", s, p)
            assert a.status == b.status, (s, p)
            assert a.norm == (pytest.approx(b.norm, rel=1e-6) if b.norm is not None else None), (s, p)
    assert reentrant.block[0].weight.grad is grad and torch.equal(grad, torch.ones_like(grad))
    assert all(p.grad is None for n, p in reentrant.named_parameters() if n != "block.0.weight")
    if "gradients" in checks:
        terms = got.checks["gradients"]["paths"]["eager"]["terms"]
        assert {t: e["status"] for t, e in terms.items()} == {"ce": "agrees", "reg": "agrees"}, terms


def test_the_block_that_no_input_reaches_is_still_found() -> None:
    torch.manual_seed(0)
    fm = _probe(Encoder(reentrant=True, frozen_embedding=True), diagnose=True)
    lost = {f"block.{i}.{k}" for i in (0, 2) for k in ("weight", "bias")}
    assert lost <= {p for p in fm.trainable if fm.cell("eager", "ce only", p).status == "none"}
    assert {f.cause for f in fm.errors()} == {"graph-break-in-model"}, gradprobe.render(fm)
    (cut,) = [f for f in fm.errors() if "block.0.weight" in f.evidence["parameters"]]
    assert (
        cut.location["op"] == "CheckpointFunction.apply" and "checkpoint(self.block" in cut.location["code"]
    )
    assert cut.fix.startswith("torch.utils.checkpoint with use_reentrant=True gives no gradient"), cut.fix
    assert "pass use_reentrant=False" in cut.fix and "(not tried)" in cut.fix
    assert audit(fm) == []
