"""``per_term``: one forward, one ``torch.autograd.grad`` per term, each scenario of several terms the
sum of its terms' gradients. Every scenario must be decided as an independent computation decides it
(a fresh forward and one gradient per scenario, statuses and norms in float64): the same statuses,
norms, failures, term values and kept gradients, for small models and for many parameter tensors;
zeros, NaN, inf, an overflowing sum, failing and constant terms, custom scenarios, sparse gradients."""

from __future__ import annotations

import gc
import math
import weakref
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


class _Blocks(nn.Module):
    """``n`` tiny blocks after the first layer's output (a residual gain and offset each)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.gains = nn.ParameterList(nn.Parameter(torch.full((4,), 1.0 + i / 1000)) for i in range(n))
        self.offsets = nn.ParameterList(nn.Parameter(torch.full((4,), i / 1000)) for i in range(n))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for g, b in zip(self.gains, self.offsets, strict=True):
            h = h + 0.01 * (h * g + b)
        return h


def _model(dtype: torch.dtype = torch.float32, blocks: int = 0) -> nn.Module:
    torch.manual_seed(0)
    layers = [
        nn.Linear(3, 4),
        *([_Blocks(blocks)] if blocks else []),
        nn.Tanh(),
        nn.Linear(4, 2),
        nn.Linear(2, 1),
    ]
    model = nn.Sequential(*layers)
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
    "a term reaching every third parameter": (
        lambda m, x: {"fit": m(x).mean(), "some": sum(p.square().sum() for p in list(m.parameters())[1::3])},
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


def _measured(case: str, dtype: torch.dtype, keep: bool = True, blocks: int = 0) -> list[measure.Measurement]:
    step, given = CASES[case]
    model, x = _model(dtype, blocks), _batch(dtype)
    _, _, results = measure.per_term(
        lambda: step(model, x),
        list(model.parameters()),
        None,
        lambda ts: resolve_scenarios(given, ts),
        keep=keep,
    )
    return results


def _batch(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(5, 3, generator=torch.Generator().manual_seed(1)).to(dtype)


def _status(g: torch.Tensor) -> str:
    g = g.to_dense().double()
    if g.isnan().any():
        return "nan"
    if g.isinf().any():
        return "inf"
    return "zero" if bool((g == 0).all()) else "nonzero"


def _expected(case: str, dtype: torch.dtype, blocks: int = 0) -> dict[str, dict[str, Any]]:
    """Per scenario, computed apart from gradprobe: a fresh forward, each term's gradient, their sum
    in the order the step returns the terms (a constant term adds nothing; a failing one fails the
    scenario), statuses and L1 norms in float64, and the term values."""
    step, given = CASES[case]
    model, x = _model(dtype, blocks), _batch(dtype)
    params = list(model.parameters())
    out: dict[str, dict[str, Any]] = {}
    for s in resolve_scenarios(given, list(step(model, x))):
        values = step(model, x)
        total: list[torch.Tensor | None] | None = None
        error = None
        for t in values:
            if t not in s.terms or not values[t].requires_grad:
                continue
            try:
                grads = torch.autograd.grad(values[t], params, retain_graph=True, allow_unused=True)
            except RuntimeError as e:
                error = str(e)
                break
            if total is None:
                total = list(grads)
            else:
                total = [
                    g if a is None else a if g is None else a + g for a, g in zip(total, grads, strict=True)
                ]
        floats = {t: float(v.detach()) for t, v in values.items()}
        read = error is None and total is not None
        out[s.name] = {
            "error": error if error is not None else None if total is not None else "NoGradPath",
            "grads": total if error is None else None,
            "statuses": ["none" if g is None else _status(g) for g in total] if read else None,  # type: ignore[union-attr]
            "norms": [None if g is None else _l1(g) for g in total] if read else None,  # type: ignore[union-attr]
            "term_values": floats,
            "total": sum(floats.values()) if read else None,
        }
    return out


def _l1(g: torch.Tensor) -> float:
    return float(g.to_dense().double().abs().sum())


def _same_float(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or abs(a - b) <= 1e-5 * max(abs(a), abs(b))


def _check(results: list[measure.Measurement], expected: dict[str, dict[str, Any]]) -> None:
    assert [m.scenario for m in results] == list(expected)
    for m in results:
        want = expected[m.scenario]
        assert m.statuses == want["statuses"], m.scenario
        assert (m.norms is None) == (want["norms"] is None), m.scenario
        if m.norms is not None:
            assert all(map(_same_float, m.norms, want["norms"])), (m.scenario, m.norms, want["norms"])
        if want["error"] is None:
            assert m.error is None, (m.scenario, m.error)
        elif want["error"] == "NoGradPath":
            assert m.error is not None and m.error.type == "NoGradPath", m.scenario
        else:
            assert m.error is not None and m.error.stage == "backward", m.scenario
            assert m.error.message == want["error"]
        assert m.term_values.keys() == want["term_values"].keys()
        assert all(_same_float(m.term_values[t], v) for t, v in want["term_values"].items())
        assert _same_float(m.total, want["total"]), m.scenario
        assert (m.grads is None) == (want["grads"] is None), m.scenario
        if m.grads is not None:
            for g, h in zip(m.grads, want["grads"], strict=True):
                assert (g is None) == (h is None)
                if g is not None and h is not None:
                    assert torch.equal(g.to_dense().nan_to_num(), h.to_dense().nan_to_num()), m.scenario
        assert m.seconds > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_each_scenario_is_what_an_independent_computation_says(case: str, dtype: torch.dtype):
    _check(_measured(case, dtype), _expected(case, dtype))


@pytest.mark.parametrize(
    "case",
    [
        "three terms, shared and lone parameters",
        "a term reaching every third parameter",
        "custom scenarios, no term alone",
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_many_parameter_tensors_are_read_as_a_few_are(case: str, dtype: torch.dtype):
    # 300 more parameter tensors of one shape (tiny blocks that every term reaches, some, or none).
    _check(_measured(case, dtype, blocks=150), _expected(case, dtype, blocks=150))


def test_without_keep_no_gradient_is_kept():
    results = _measured("plain", torch.float32, keep=False)
    assert all(m.grads is None for m in results) and all(m.statuses is not None for m in results)


def test_what_the_cases_decide():
    # The independent computation agrees with the construction of each case (a term's own
    # parameters, exact zeros, NaN, inf, a finite sum past float32, failures, constant terms).
    (fit,) = [m for m in _measured("plain", torch.float32) if m.scenario == "decay only"]
    # Parameter order: the Sequential's own ``extra`` first, then 0.weight, 0.bias, 2.weight, ...
    assert fit.statuses == ["none", "nonzero"] + ["none"] * 5
    by = {m.scenario: m for m in _measured("nan and inf", torch.float32)}
    assert by["nan only"].statuses[1] == "nan" and by["inf only"].statuses[3] == "inf"
    assert by["all"].statuses[:4] == ["none", "nan", "nonzero", "inf"]
    by = {m.scenario: m for m in _measured("a finite L1 sum past float32", torch.float32)}
    norm = by["big only"].norms[1]
    assert (
        by["big only"].statuses[1] == "nonzero" and norm is not None and math.isfinite(norm) and norm > 3e38
    )
    by = {m.scenario: m for m in _measured("exact zeros", torch.float32)}
    assert by["zero only"].statuses[3] == "zero" and by["zero only"].norms[3] == 0.0
    by = {m.scenario: m for m in _measured("a backward that raises", torch.float32)}
    assert by["bad only"].error is not None and by["bad only"].error.stage == "backward"
    assert by["all"].error is not None and by["fit only"].error is None
    by = {m.scenario: m for m in _measured("a constant term (no grad path)", torch.float32)}
    assert by["const only"].error is not None and by["const only"].error.type == "NoGradPath"
    assert by["all"].error is None and by["all"].statuses == by["fit only"].statuses
    by = {m.scenario: m for m in _measured("custom scenarios with a failing term", torch.float32)}
    assert by["a+bad"].error is not None and by["a+bad"].error.stage == "backward"
    assert by["a+k"].statuses == by["a alone"].statuses and by["k alone"].error.type == "NoGradPath"


def test_sparse_gradients_are_summed_and_read():
    torch.manual_seed(0)
    model = nn.ModuleDict({"emb": nn.Embedding(10, 3, sparse=True), "out": nn.Linear(3, 1)})
    idx = torch.tensor([1, 2, 2])

    def step() -> dict[str, torch.Tensor]:
        y = model["out"](model["emb"](idx))
        return {"fit": y.mean(), "emb": model["emb"](idx).sum()}

    scenarios = (Scenario("fit only", ("fit",)), Scenario("all", ("fit", "emb")))
    _, _, results = measure.per_term(step, list(model.parameters()), None, lambda ts: scenarios)
    assert [m.statuses for m in results] == [["nonzero"] * 3, ["nonzero"] * 3]
    weight = model["emb"].weight
    out = step()
    expected = sum(torch.autograd.grad(out[t], weight)[0].to_dense() for t in ("fit", "emb")).abs().sum()
    assert results[1].norms[0] == pytest.approx(float(expected), rel=1e-6)


class _Check(torch.autograd.Function):
    """Identity whose backward runs a check (inside the backward of the term it is part of)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, check: Callable[[], None]) -> torch.Tensor:
        ctx.check = check
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.check()
        return g, None


def test_a_terms_gradients_are_released_before_the_next_backward():
    # Holding every term's gradients through the next backward would hold tens of thousands of
    # tensors at 8,192 parameter tensors: a term whose gradients no other scenario sums is read and
    # let go before the next term's backward runs.
    model = _model(torch.float32)
    x = _batch(torch.float32)
    first: list[weakref.ref[torch.Tensor]] = []
    alive: list[bool] = []

    def remember(g: torch.Tensor) -> None:
        first.append(weakref.ref(g))

    def check() -> None:
        gc.collect()
        alive.append(any(r() is not None for r in first))

    handle = model[0].weight.register_hook(remember)
    try:
        scenarios = [Scenario("first only", ("first",)), Scenario("second only", ("second",))]
        measure.per_term(
            lambda: {"first": model[0].weight.sum(), "second": _Check.apply(model(x), check).sum()},
            list(model.parameters()),
            None,
            lambda ts: scenarios,
        )
    finally:
        handle.remove()
    assert first and alive == [False]
