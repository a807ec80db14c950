"""The benchmark script keeps working: ``benchmarks/bench_probe.py --quick`` runs and prints its sections.

Only the structure is checked, not the PASS/FAIL lines: timings on a shared machine are noisy and the
quick run's sizes are too small for its ratios to mean anything (docs/benchmarks.md).
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

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
