"""A synthetic flow map of any size, shaped like a real probe's: two variants (eager and a traced one
with value verdicts), four scenarios, every parameter a cell in every run, a few percent unreached or
wrong, and findings whose evidence lists parameters. 137,000 parameters give about 200 MB of JSON.

Used by ``bench_scale.py`` (full size) and ``tests/test_scale.py`` (small sizes).
"""

from __future__ import annotations

from gradprobe.flowmap import Cell, Finding, FlowMap, ParameterInfo, Run, ScenarioInfo, VariantInfo

TERMS = ("energy", "force", "virial")
SCENARIOS = tuple(ScenarioInfo(f"{t} only", (t,)) for t in TERMS) + (ScenarioInfo("all", TERMS),)
VARIANTS = ("eager", "make_fx")


def parameter_names(n: int) -> list[str]:
    """``blocks.<i>.layer<j>.weight|bias``: names of the lengths real models have."""
    return [f"blocks.{i // 8}.layer{(i // 2) % 4}.{'weight' if i % 2 == 0 else 'bias'}" for i in range(n)]


def synthetic_map(n: int, *, seed: int = 0, changed_every: int = 0) -> FlowMap:
    """A flow map of ``n`` parameters. ``changed_every=k``: every k-th parameter of the traced variant is
    missing in "force only" (a second map to diff against)."""
    names = parameter_names(n)
    params = tuple(ParameterInfo(name, (64, 64), 4096, True, "float32", "cpu") for name in names)
    cells: list[Cell] = []
    runs: list[Run] = []
    for v in VARIANTS:
        for s in SCENARIOS:
            runs.append(Run(v, s.name, {t: 0.5 + seed for t in TERMS}, 1.5, None, 0.01))
            for i, name in enumerate(names):
                norm = 1.0 + ((i * 7919 + seed) % 1000) / 997
                status = "none" if i % 50 == 0 and s.name == "force only" else "nonzero"
                if v == "eager":
                    cells.append(Cell(v, s.name, name, status, None if status == "none" else norm))
                    continue
                lost = changed_every and i % changed_every == 0 and s.name == "force only"
                got = "zero" if lost else status
                verdict = "missing" if lost and status == "nonzero" else "match"
                cells.append(Cell(v, s.name, name, got, 0.0 if got == "zero" else norm, 0.0, verdict))
    lost = [n_ for i, n_ in enumerate(names) if changed_every and i % changed_every == 0]
    findings = [
        Finding(
            "unused-parameter",
            "info",
            f"{n // 50} parameter(s) get no gradient from force",
            evidence={"parameters": names[::50]},
        )
    ]
    if lost:
        findings.append(
            Finding(
                "flow-mismatch",
                "error",
                f"force only, make_fx: {len(lost)} lost",
                evidence={"variant": "make_fx", "parameters": lost, "runs": [["make_fx", "force only"]]},
            )
        )
    return FlowMap(
        torch_version="2.13.0",
        device="cpu",
        dtype="float32",
        mode="terms",
        terms=TERMS,
        scenarios=SCENARIOS,
        variants=tuple(VariantInfo(v, capture="make_fx" if v != "eager" else "eager") for v in VARIANTS),
        runs=tuple(runs),
        parameters=params,
        cells=tuple(cells),
        findings=tuple(findings),
        gradprobe_version="0.1.0",
        reference="eager",
        rtol=1e-5,
    )
