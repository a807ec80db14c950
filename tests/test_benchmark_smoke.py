"""The benchmark script keeps working: ``benchmarks/bench_probe.py --quick`` runs and prints its sections.

Only the structure is checked, not the PASS/FAIL verdicts: timings on a shared machine are noisy and the
quick run's sizes are too small for its ratios to mean anything (docs/benchmarks.md).
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_probe.py"

SECTIONS = [
    "== 1. probe, naive loop and floor (eager) ==",
    "== 2. compiles per compiled variant ==",
    "== 3. host syncs per scenario, flow-map size ==",
    "== 4. diagnose when nothing fails ==",
    "== requirements ==",
]
# The start of each requirement's verdict line, after "PASS  " or "FAIL  ".
REQUIREMENTS = [
    "probe <= 1.15 x floor + 1 ms on every model",
    "probe faster than the naive loop on every model",
    "probe scaling exponent within 10% of the floor's",
    "compiled probe compiles once for all",
    "probe host syncs per scenario constant",
    "diagnose <= 1.5 x the probe when nothing fails",
]
# Every model of section 1, each named in the two verdict lines that cover every model.
MODELS = [
    "reference potential 14",
    "wide ",
    "small functional 10",
    "MLP 10",
    "transformer layer 15",
    "tiny blocks ",
]


@pytest.mark.slow
def test_quick_benchmark_runs_and_prints_its_sections_and_verdicts(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(tmp_path / "out.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = proc.stdout
    positions = [out.find(s) for s in SECTIONS]
    assert all(p >= 0 for p in positions), [s for s, p in zip(SECTIONS, positions, strict=True) if p < 0]
    assert positions == sorted(positions), "sections out of order"
    verdicts = [line[6:] for line in out.splitlines() if line.startswith(("PASS  ", "FAIL  "))]
    assert len(verdicts) == len(REQUIREMENTS), verdicts
    for requirement, line in zip(REQUIREMENTS, verdicts, strict=True):
        assert line.startswith(requirement), (requirement, line)
    for line in verdicts[:2]:
        assert all(m in line for m in MODELS) and line.count("tiny blocks ") == 3, line
    # The diagnosis's lineage and gradients checks, each on its own line.
    assert "      lineage check on its own: " in out and "      gradients check on its own: " in out, out[
        -2000:
    ]
    assert (tmp_path / "out.json").stat().st_size > 0
