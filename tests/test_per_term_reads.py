"""A small model's gradients are held until the last backward and read at once (``HELD_TENSORS``); a
big one's are read term by term, each released before the next backward. Both must decide every
scenario the same way: the same statuses, norms, failures, term values and kept gradients; and what
they decide must be right (zeros, NaN, inf, an overflowing sum, failing and constant terms)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from gradprobe import measure
from gradprobe.scenarios import Scenario, resolve_scenarios


class _Raising(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this backward always fails")


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2), nn.Linear(2, 1))
    model.extra = nn.Parameter(torch.ones(3))  # reached by no term
    return model.to(dtype)


# Each case: the terms a step returns from the model and a batch, and the scenarios (None: defaults).
CASES: dict[str, tuple[Callable[[nn.Module, torch.Tensor], dict[str, torch.Tensor]], Any]] = {
    "plain": (lambda m, x: {"fit": m(x).pow(2).mean(), "decay": m[0].weight.square().sum()}, None),
    "three terms, shared and lone parameters": (
        lambda m, x: {
            "fit": m(x).mean(),
            "head": m[3].bias.sum() * 2,
            "first": m[0](x).abs().sum(),
        },
        None,
    ),
    "a term whose one path gives exact zeros": (
        lambda m, x: {"fit": m(x).mean(), "dead": (m(x).detach() * 0 + x.sum()).sum() + m.extra.sum() * 0},
        None,
    ),
    "a constant term (no grad path)": (lambda m, x: {"fit": m(x).mean(), "const": x.sum()}, None),
    "a backward that raises": (
        lambda m, x: {"fit": m(x).mean(), "bad": _Raising.apply(m[0](x)).sum()},
        None,
    ),
    "exact zeros": (lambda m, x: {"fit": m(x).mean(), "zero": (m[2].weight * 0).sum()}, None),
    "nan and inf": (
        lambda m, x: {
            "nan": (m[0].weight.sum() * torch.tensor(float("nan"))),
            "inf": (m[2].weight.sum() * torch.tensor(float("inf"))),
            "fit": m(x).mean(),
        },
        None,
    ),
    "a finite L1 sum past float32": (
        lambda m, x: {"big": (m[0].weight * 3e37).sum(), "fit": m(x).mean()},
        None,
    ),
    "custom scenarios, no term alone": (
        lambda m, x: {"a": m(x).mean(), "b": m[0].bias.sum(), "c": m[3].weight.sum()},
        {"ab": ["a", "b"], "bc": ["b", "c"], "abc": ["a", "b", "c"]},
    ),
    "custom scenarios with a failing term": (
        lambda m, x: {"a": m(x).mean(), "bad": _Raising.apply(m[0](x)).sum(), "k": x.sum()},
        {"a alone": ["a"], "a+bad": ["a", "bad"], "a+k": ["a", "k"], "k alone": ["k"]},
    ),
}


def _measured(
    case: str, dtype: torch.dtype, held: bool, keep: bool, monkeypatch: pytest.MonkeyPatch
) -> list[measure.Measurement]:
    step, given = CASES[case]
    model = _model(dtype)
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(1)).to(dtype)
    params = list(model.parameters())
    with monkeypatch.context() as m:
        if not held:
            m.setattr(measure, "HELD_TENSORS", 0)  # term by term, as for a big model
        _, _, results = measure.per_term(
            lambda: step(model, x), params, None, lambda ts: resolve_scenarios(given, ts), keep=keep
        )
    return results


def _same_float(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or abs(a - b) <= 1e-5 * max(abs(a), abs(b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_small_models_are_read_as_big_ones_are(case: str, dtype: torch.dtype, monkeypatch):
    held = _measured(case, dtype, True, True, monkeypatch)
    one_by_one = _measured(case, dtype, False, True, monkeypatch)
    assert [m.scenario for m in held] == [m.scenario for m in one_by_one]
    for a, b in zip(held, one_by_one, strict=True):
        assert a.statuses == b.statuses, a.scenario
        assert a.norms is not None or b.norms is None
        if a.norms is not None:
            assert b.norms is not None
            assert all(map(_same_float, a.norms, b.norms)), (a.scenario, a.norms, b.norms)
        assert (a.error is None) == (b.error is None), a.scenario
        if a.error is not None and b.error is not None:
            assert (a.error.stage, a.error.type, a.error.message) == (
                b.error.stage,
                b.error.type,
                b.error.message,
            )
        assert a.term_values.keys() == b.term_values.keys()
        assert all(_same_float(a.term_values[t], b.term_values[t]) for t in a.term_values)
        assert _same_float(a.total, b.total)
        assert (a.grads is None) == (b.grads is None), a.scenario
        if a.grads is not None and b.grads is not None:
            for g, h in zip(a.grads, b.grads, strict=True):
                assert (g is None) == (h is None)
                if g is not None and h is not None:
                    assert torch.equal(g.nan_to_num(), h.nan_to_num())
        assert a.seconds > 0


def test_the_held_read_decides_what_the_case_says(monkeypatch):
    # Not only the same held or one by one: right. A term's own parameters, exact zeros, NaN, inf,
    # a finite sum past float32 (a finite gradient: nonzero, its norm finite in float64), failures.
    (fit,) = [
        m for m in _measured("plain", torch.float32, True, False, monkeypatch) if m.scenario == "decay only"
    ]
    # Parameter order: the Sequential's own ``extra`` first, then 0.weight, 0.bias, 2.weight, ...
    assert fit.statuses == ["none", "nonzero"] + ["none"] * 5
    by = {m.scenario: m for m in _measured("nan and inf", torch.float32, True, False, monkeypatch)}
    assert by["nan only"].statuses[1] == "nan" and by["inf only"].statuses[3] == "inf"
    assert by["all"].statuses[:4] == ["none", "nan", "nonzero", "inf"]
    by = {
        m.scenario: m
        for m in _measured("a finite L1 sum past float32", torch.float32, True, False, monkeypatch)
    }
    norm = by["big only"].norms[1]
    assert (
        by["big only"].statuses[1] == "nonzero" and norm is not None and math.isfinite(norm) and norm > 3e38
    )
    by = {m.scenario: m for m in _measured("exact zeros", torch.float32, True, False, monkeypatch)}
    assert by["zero only"].statuses[3] == "zero" and by["zero only"].norms[3] == 0.0
    by = {m.scenario: m for m in _measured("a backward that raises", torch.float32, True, False, monkeypatch)}
    assert by["bad only"].error is not None and by["bad only"].error.stage == "backward"
    assert by["all"].error is not None and by["fit only"].error is None
    by = {
        m.scenario: m
        for m in _measured("a constant term (no grad path)", torch.float32, True, False, monkeypatch)
    }
    assert by["const only"].error is not None and by["const only"].error.type == "NoGradPath"
    assert by["all"].error is None and by["all"].statuses == by["fit only"].statuses


def test_sparse_gradients_are_read_held_or_not(monkeypatch):
    torch.manual_seed(0)
    model = nn.ModuleDict({"emb": nn.Embedding(10, 3, sparse=True), "out": nn.Linear(3, 1)})
    idx = torch.tensor([1, 2, 2])

    def step() -> dict[str, torch.Tensor]:
        y = model["out"](model["emb"](idx))
        return {"fit": y.mean(), "emb": model["emb"](idx).sum()}

    scenarios = (Scenario("fit only", ("fit",)), Scenario("all", ("fit", "emb")))
    for held in (64, 0):
        monkeypatch.setattr(measure, "HELD_TENSORS", held)
        _, _, results = measure.per_term(step, list(model.parameters()), None, lambda ts: scenarios)
        assert [m.statuses for m in results] == [["nonzero"] * 3, ["nonzero"] * 3]
        weight = model["emb"].weight
        out = step()
        expected = sum(torch.autograd.grad(out[t], weight)[0].to_dense() for t in ("fit", "emb")).abs().sum()
        assert results[1].norms[0] == pytest.approx(float(expected), rel=1e-6)
