"""Multi-step forecasting of a noisy multi-sensor series with a GRU cell unrolled over time; each
step's hidden state is written into a preallocated ``states`` tensor and a linear readout forecasts
the next value from every state ("forecast"); a second term scores the readout of the final state
("horizon"), so the cell is still reached by the step.

Bugs (real cuts through a buffer write):

- ``rnn-states-data``: the write is ``states[t] = h.data`` in the reference step;
- ``rnn-states-no-grad``: a compiled user trainer copies the states in (``states[t].copy_(h)``) under
  ``torch.no_grad()``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as nnf

import gradprobe

from . import autograd_of, case, grown, moves, new_code, ones_for, params_of, reached, truth, weighted

SENSORS, HIDDEN, STEPS = 3, 12, 8
TERMS = ("forecast", "horizon")


class Forecaster(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.GRUCell(SENSORS, HIDDEN)
        self.readout = nn.Linear(HIDDEN, SENSORS)


def series() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(18)
    t = torch.arange(STEPS + 1, dtype=torch.float64)[:, None, None]
    phase = torch.rand(1, 5, SENSORS, generator=g, dtype=torch.float64) * 6.28
    signal = torch.sin(0.7 * t + phase) + 0.05 * torch.randn(
        STEPS + 1, 5, SENSORS, generator=g, dtype=torch.float64
    )
    return {"signal": signal[:-1], "next_signal": signal[1:]}


def unroll(net: Forecaster, batch: dict[str, torch.Tensor], by_value: bool) -> dict[str, torch.Tensor]:
    x = batch["signal"]
    h = x.new_zeros(x.shape[1], HIDDEN)
    states = x.new_zeros(STEPS, x.shape[1], HIDDEN)
    for t in range(STEPS):
        h = net.cell(x[t], h)
        if by_value:
            states[t] = h.data  # ROOT rnn-states-data
        else:
            states[t] = h
    return {
        "forecast": nnf.mse_loss(net.readout(states), batch["next_signal"]),
        "horizon": nnf.mse_loss(net.readout(h), batch["next_signal"][-1]),
    }


def forecast_step(net: Forecaster, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return unroll(net, batch, by_value=False)


def buggy_forecast_step(net: Forecaster, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return unroll(net, batch, by_value=True)


@case(
    "rnn-states-data",
    family="sequence",
    mechanism=".data into a preallocated tensor",
    expect={"graph-break-in-model", "gradient-mismatch"},
)
def build_data(fixed: bool):
    return grown(19, Forecaster), forecast_step if fixed else buggy_forecast_step, series(), {}


def _check_cut(grads_of_forecast: dict, value, params, cut: bool) -> None:
    cell = [k for k in params if k.startswith("cell.")]
    assert reached(grads_of_forecast["readout.weight"])
    if cut:
        assert not any(reached(grads_of_forecast[k]) for k in cell), grads_of_forecast
        assert moves(value, params["cell.weight_hh"]) > 1e-9  # the value depends on the cell
    else:
        assert all(reached(grads_of_forecast[k]) for k in cell)


@truth("rnn-states-data")
def check_data(fixed: bool) -> None:
    net, step, batch, _ = build_data(fixed)
    params = params_of(net)
    grads = autograd_of(step(net, batch)["forecast"], params)
    _check_cut(grads, lambda: step(net, batch)["forecast"], params, cut=not fixed)
    assert all(reached(g) for g in autograd_of(step(net, batch)["horizon"], params).values() if g is not None)


# ----- rnn-states-no-grad: the compiled trainer path -------------------------------------------------


def logging_trainer(log_without_grad: bool):
    def builder(ctx):
        net = ctx.model

        def losses(batch, weights):
            x = batch["signal"]
            h = x.new_zeros(x.shape[1], HIDDEN)
            states = x.new_zeros(STEPS, x.shape[1], HIDDEN)
            for t in range(STEPS):
                h = net.cell(x[t], h)
                if log_without_grad:
                    with torch.no_grad():
                        states[t].copy_(h)  # ROOT rnn-states-no-grad
                else:
                    states[t].copy_(h)
            terms = {
                "forecast": nnf.mse_loss(net.readout(states), batch["next_signal"]),
                "horizon": nnf.mse_loss(net.readout(h), batch["next_signal"][-1]),
            }
            return weighted(terms, weights)

        return torch.compile(new_code(losses), backend="eager")

    return builder


@case(
    "rnn-states-no-grad",
    family="sequence",
    mechanism="no_grad write into a preallocated tensor",
    container="opaque-compiled",
    expect={"graph-break-in-model", "gradient-mismatch"},
)
def build_no_grad(fixed: bool):
    path = gradprobe.variants.user_variant("logging_trainer", logging_trainer(log_without_grad=not fixed))
    return grown(20, Forecaster), forecast_step, series(), {"variants": ["eager", path], "terms": list(TERMS)}


@truth("rnn-states-no-grad")
def check_no_grad(fixed: bool) -> None:
    net, step, batch, kw = build_no_grad(fixed)
    run = kw["variants"][1].builder(type("Ctx", (), {"model": net, "batch": batch})())
    only = ones_for(TERMS, ["forecast"], torch.float64)
    total, values = run(batch, only)
    torch.testing.assert_close(values["forecast"], step(net, batch)["forecast"])
    params = params_of(net)
    _check_cut(autograd_of(total, params), lambda: run(batch, only)[0], params, cut=not fixed)
