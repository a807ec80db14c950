"""Scale: the checks' memory stays within a small multiple of the model's parameter memory, and reading
and comparing saved flow maps is linear in their size.

Memory is measured with ``live_bytes.LiveBytes`` (every storage an op allocates, until it is freed): CPU
torch keeps no allocator statistics. "Beyond a plain step" subtracts the peak of one forward and
gradient of the step, which any training needs anyway. ``benchmarks/bench_scale.py`` measures the same at
full size (a 200 MB flow map).
"""

from __future__ import annotations

import gc
import importlib
import math
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
from live_bytes import parameter_bytes, peak_bytes
from torch import nn

import gradprobe
from gradprobe.errors import FlowMapFormatError
from gradprobe.flowdiff import diff_maps
from gradprobe.flowmap import FlowMap
from gradprobe.report.html import render_html
from gradprobe.report.markdown import render_markdown

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


# ---------------------------------------------------------------------------- saved flow maps
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from large_map import synthetic_map  # noqa: E402


def _seconds(call: Any) -> float:
    """The fastest of five runs, the collector paused (noise on a shared machine only ever adds time; a
    collection triggered inside one run but not the other skewed a ratio to 9.7x under load)."""
    best = math.inf
    for _ in range(5):
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - start)
        finally:
            gc.enable()
    return best


def test_reading_rendering_and_diffing_a_flow_map_is_linear_in_its_size():
    # 4x the parameters: about 4x the time when linear; quadratic work (a set rebuilt per parameter, a
    # tuple searched per parameter) took 16x and 13 minutes for a 200 MB map.
    small, large = 1_500, 6_000
    times = {}
    for n in (small, large):
        a, b = synthetic_map(n), synthetic_map(n, seed=1, changed_every=7)
        text = b.to_json()
        times[n] = {
            "read": _seconds(lambda text=text: FlowMap.from_json(text)),
            "terminal": _seconds(lambda b=b: gradprobe.render(b, show_all=True)),
            "markdown": _seconds(lambda b=b: render_markdown(b)),
            "html": _seconds(lambda b=b: render_html(b)),
            "diff": _seconds(lambda a=a, b=b: diff_maps(a, b).render()),
        }
    for what in times[small]:
        ratio = times[large][what] / max(times[small][what], 1e-3)
        assert ratio < 8, f"{what}: {ratio:.1f}x the time for 4x the parameters ({times[large][what]:.2f}s)"


def _read_peak(text: str, tmp_path: Path) -> tuple[int, FlowMap | FlowMapFormatError]:
    path = tmp_path / "map.json"
    path.write_text(text)
    tracemalloc.start()
    try:
        outcome: FlowMap | FlowMapFormatError = FlowMap.from_json(path)
    except FlowMapFormatError as e:
        outcome = e
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak, outcome


HEAD = '{"schema": "gradprobe.flowmap/1", "x": ['


@pytest.mark.parametrize(
    ("item", "refused"),
    [
        ("[]", True),  # 20 MB of these took 1.2 GB
        ("{}", True),
        ('{"a": 1}', True),
        ('"ab"', True),
        ("[1.5]", True),
        ("[[[]]]", True),
        ("1.5", False),  # no more than 10x: accepted, and then refused for what it lacks
        ('"a string of some length"', False),
    ],
)
def test_reading_a_hostile_file_needs_at_most_10x_its_size(item, refused, tmp_path):
    text = HEAD + ",".join([item] * (2_000_000 // (len(item) + 1))) + "]}"
    peak, outcome = _read_peak(text, tmp_path)
    assert isinstance(outcome, FlowMapFormatError)
    assert ("too many values" in str(outcome)) == refused, str(outcome)
    assert peak <= 10 * len(text), f"{peak / len(text):.1f}x the file size"


@pytest.mark.parametrize("indent", [1, None])
def test_reading_a_real_flow_map_needs_at_most_10x_its_size(indent, tmp_path):
    fm = synthetic_map(3_000, changed_every=7)
    text = fm.to_json(indent=indent)
    peak, outcome = _read_peak(text, tmp_path)
    assert outcome == fm
    assert peak <= 10 * len(text), f"{peak / len(text):.1f}x the file size"
