"""The benchmark script keeps working: ``benchmarks/bench_probe.py --quick`` runs and prints its sections.

Only the structure is checked, not the PASS/FAIL lines: timings on a shared machine are noisy and the
quick run's sizes are too small for its ratios to mean anything (docs/benchmarks.md).
"""

import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_state import assert_same, snapshot

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_probe.py"

SECTIONS = [
    "== 1. probe vs naive loop (eager) ==",
    "== 2. probe vs floor ==",
    "== 3. compiles per compiled variant ==",
    "== 4. host syncs per scenario ==",
    "== 5. memory and flow-map size ==",
    "== 6. other model shapes (eager) ==",
    "== 7. diagnose time (reference potential) ==",
    "== 8. diagnose time (real package) ==",
    "== requirements ==",
]


def _run(script: Path, *args: str) -> str:
    """The stdout of ``python script args...`` run from the repository root; it must exit 0."""
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow
def test_quick_benchmark_runs_and_prints_its_sections():
    out = _run(SCRIPT, "--quick")
    positions = [out.find(s) for s in SECTIONS]
    assert all(p >= 0 for p in positions), [s for s, p in zip(SECTIONS, positions, strict=True) if p < 0]
    assert positions == sorted(positions), "sections out of order"
    # Section 8 needs SchNetPack: its table when it is installed, else one line saying it was skipped.
    real = out[positions[-2] : positions[-1]]
    if importlib.util.find_spec("schnetpack") is None:
        assert "skipped: SchNetPack is not installed" in real, real
    else:
        assert "eager,compile_model:eager" in real and "lineage, eager,make_fx: eager" in real, real
        assert "make_fx: detach=keep → alias" in real, real  # the bisection's trials, with their times
    # One PASS or FAIL line per requirement (whatever their verdicts).
    verdicts = [line for line in out.splitlines() if line.startswith(("PASS  ", "FAIL  "))]
    assert len(verdicts) >= 12, out[-3000:]


def _model_rows(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(("small functional", "MLP", "transformer"))]


@pytest.mark.slow
def test_ab_and_bound_scripts_run():
    # benchmarks/ab_small.py (two trees in alternating processes; here the same tree twice) and
    # benchmarks/bound_small.py (a minimal state-keeping probe and the work inside gradprobe's state
    # guarantee, against the floor) run and print a row per small model; their numbers are not checked
    # (two rounds mean nothing).
    src = str(ROOT / "src")
    rows = _model_rows(_run(ROOT / "benchmarks" / "ab_small.py", src, src, "--pairs", "1", "--reps", "2"))
    assert len(rows) == 3, rows
    # Every row holds its measured numbers (ratios per tree and their difference).
    assert all(len(re.findall(r"\d+\.\d{3}", row)) >= 4 for row in rows), rows

    for how in ("--phases", "--warm"):  # cold (section 6's method) with the levels; warm without
        out = _run(ROOT / "benchmarks" / "bound_small.py", "--reps", "2", how)
        rows = _model_rows(out)
        # The table of contenders, then (--phases) the guarantee's levels.
        assert len(rows) == (6 if how == "--phases" else 3), out
        times, levels = rows[:3], rows[3:]
        # Six times in ms and four ratios per model; a ratio per level.
        assert all(len(re.findall(r"\d+\.\d{3}", row)) == 6 for row in times), times
        assert all(len(re.findall(r"\d+\.\d{2}x", row)) == 4 for row in times), times
        assert all(len(re.findall(r"\d+\.\d{2}x", row)) == 4 for row in levels), levels


def _bound_small():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bound_small
        from other_models import make_mlp, mlp_step
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return bound_small, make_mlp, mlp_step


def test_listed_contender_keeps_what_it_lists():
    # bound_small.listed is the yardstick for the part of the guarantee the developers' guide lists:
    # it must keep that part, or the gap it measures means nothing. The MLP's step updates BatchNorm's
    # running statistics and draws dropout masks: _work alone leaves both changed.
    bound_small, make_mlp, mlp_step = _bound_small()
    model, batch = make_mlp()
    model[0].weight.grad = torch.ones_like(model[0].weight)
    before = snapshot(model)
    params = [p for p in model.parameters() if p.requires_grad]
    bound_small._work(model, mlp_step, batch, params)
    with pytest.raises(AssertionError):  # the check below can fail
        assert_same(before, snapshot(model))

    model, batch = make_mlp()
    model[0].weight.grad = torch.ones_like(model[0].weight)
    before = snapshot(model)
    values = bound_small.listed(model, mlp_step, batch)
    assert len(values) > 3 and all(map(math.isfinite, values))
    assert_same(before, snapshot(model))

    def rough(m, b):  # replaces a storage, edits values in place, flips flags and modes, drops a .grad
        out = mlp_step(m, b)
        with torch.no_grad():
            m[0].weight.data = torch.zeros_like(m[0].weight)
            m[4].bias.mul_(3)
        m[1].eval()
        m[7].bias.requires_grad_(False)
        m[0].weight.grad = None
        return out

    storage = model[0].weight.untyped_storage().data_ptr()
    # The flipped flag makes the work's autograd.grad fail: the state is put back all the same.
    with pytest.raises(RuntimeError, match="does not require grad"):
        bound_small.listed(model, rough, batch)
    assert_same(before, snapshot(model))
    assert model[0].weight.untyped_storage().data_ptr() == storage  # its own storage, not a copy
