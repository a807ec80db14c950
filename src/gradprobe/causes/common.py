"""Small helpers shared by detectors."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


def module_of(parameter: str) -> str:
    """``fitting.layer1.bias`` -> ``fitting.layer1``; a top-level parameter is its own module ``''``."""
    return parameter.rpartition(".")[0]


def failed_runs(fm, variant: str, predicate) -> list[str]:  # type: ignore[no-untyped-def]
    """Scenarios of ``variant`` whose run error satisfies ``predicate``."""
    return [
        r.scenario for r in fm.runs if r.variant == variant and r.error is not None and predicate(r.error)
    ]


def differing(fm, variant: str) -> list[str]:  # type: ignore[no-untyped-def]
    """Scenarios where ``variant``'s cells differ from the reference (missing, extra or wrong)."""
    return [s for s in fm.scenario_names if fm.differences(variant, s)]


def where(b: Mapping) -> str:  # type: ignore[type-arg]
    """'potential.py:68 in descriptor (Descriptor): g = torch.tanh(...)' from a break or graph fact."""
    import os

    file = os.path.basename(str(b.get("file", "?")))
    module = b.get("module")
    mod = (
        f" in {module or 'the root module'}" + (f" ({b['module_type']})" if b.get("module_type") else "")
        if module is not None
        else ""
    )
    code = f": {b['code']}" if b.get("code") else ""
    return f"{file}:{b.get('line', '?')}{mod}{code}"


def runs_of(variant: str, scenarios: Iterable[str]) -> list[list[str]]:
    return [[variant, s] for s in scenarios]


@dataclass
class Explained:
    """What specific causes already explain: (variant, scenario) runs and parameter names."""

    runs: set[tuple[str, str]] = field(default_factory=set)
    parameters: set[str] = field(default_factory=set)

    def add(self, evidence: Mapping) -> None:  # type: ignore[type-arg]
        self.runs.update((v, s) for v, s in evidence.get("runs") or ())
        self.parameters.update(evidence.get("parameters") or ())


def physics_results(fm) -> list[tuple[str, dict]]:  # type: ignore[no-untyped-def,type-arg]
    """(path, physics check result) for the reference (``checks["physics"]``) and for every path checked
    on its own forces (``checks["physics_paths"]``), failing or not; skipped paths left out."""
    out = []
    if fm.checks.get("physics"):
        out.append((fm.reference, fm.checks["physics"]))
    for v, r in (fm.checks.get("physics_paths") or {}).items():
        if isinstance(r, dict) and not r.get("skipped"):
            out.append((v, r))
    return out


def failures(fm, variant: str, matches) -> tuple[list[str], list]:  # type: ignore[no-untyped-def]
    """The scenarios of ``variant`` whose run error ``matches``, and the matching errors (the build's
    first, when the build failed that way)."""
    v = fm.variant(variant)
    failed = [r for r in fm.runs if r.variant == variant and r.error is not None and matches(r.error)]
    errors = [v.error] if v.error is not None and matches(v.error) else []
    return [r.scenario for r in failed], errors + [r.error for r in failed]


def failing_variants(fm, matches):  # type: ignore[no-untyped-def]
    """``(variant, failed scenarios, first matching error)`` for each variant with a failure ``matches``."""
    for v in fm.variants:
        failed, errors = failures(fm, v.name, matches)
        if errors:
            yield v, failed, errors[0]


def in_frames(error, *functions: str) -> bool:  # type: ignore[no-untyped-def]
    """Whether a recorded traceback frame of ``error`` is in one of ``functions``."""
    return any(f.rpartition(" in ")[2] in functions for f in getattr(error, "frames", ()) or ())


def at_user(error) -> str:  # type: ignore[no-untyped-def]
    """' at potential.py:12 in forward: e = ...' from the error's user frame, or ''."""
    at = error.where or {}
    return f" at {where(at)}" if at else ""


def knob_trial(fm, variant: str, knob: str) -> dict | None:  # type: ignore[no-untyped-def,type-arg]
    """The bisection trial of ``variant`` that flipped ``knob`` (what the flip measured), if any."""
    b = fm.bisection(variant) or {}
    return next((t for t in b.get("trials") or () if t.get("knob") == knob), None)
