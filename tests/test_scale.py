"""Scale: the checks' memory stays within a small multiple of the model's parameter memory, and reading
and comparing saved flow maps is linear in their size.

Memory is measured with ``live_bytes.LiveBytes`` (every storage an op allocates, until it is freed): CPU
torch keeps no allocator statistics. "Beyond a plain step" subtracts the peak of one forward and
gradient of the step, which any training needs anyway. ``scripts/bench_scale.py`` measures the same at
full size (a 200 MB flow map).
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
from live_bytes import parameter_bytes, peak_bytes
from torch import nn

import gradprobe

probe_module = importlib.import_module("gradprobe.probe")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.Tanh()) for _ in range(8)])


X = torch.randn(32, 128, generator=torch.Generator().manual_seed(0))


def _step(m: nn.Module, b: torch.Tensor) -> dict[str, torch.Tensor]:
    y = m(b)
    return {"fit": y.pow(2).mean(), "reg": y.abs().mean()}


def _plain_step_peak(model: nn.Module) -> int:
    def plain() -> Any:
        return torch.autograd.grad(sum(_step(model, X).values()), list(model.parameters()))

    return peak_bytes(plain)[1]


def _peak_of(name: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Wrap the probe's call of one check so that its peak memory is recorded."""
    found: dict[str, int] = {}
    check = getattr(probe_module, name)

    def measured(*args: Any, **kwargs: Any) -> Any:
        result, found[name] = peak_bytes(lambda: check(*args, **kwargs))
        return result

    monkeypatch.setattr(probe_module, name, measured)
    return found


@pytest.mark.parametrize(
    ("check", "function", "limit"),
    [
        # Per-term statistics and one optimizer step per term, one parameter tensor at a time.
        ("balance", "balance_report", 2.0),
        # A copy of the model and Adam's two moments.
        ("training", "training_check", 3.5),
    ],
)
def test_a_check_needs_little_memory_beyond_a_plain_step(check, function, limit, monkeypatch):
    model = _model()
    params = parameter_bytes(model)
    plain = _plain_step_peak(model)
    found = _peak_of(function, monkeypatch)
    fm = gradprobe.probe(model, _step, X, checks=[check])
    assert not [f for f in fm.findings if f.cause == "check-could-not-run"]
    beyond = (found[function] - plain) / params
    assert beyond <= limit, f"the {check} check needs {beyond:.2f}x the parameter memory beyond a plain step"
