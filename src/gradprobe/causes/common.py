"""Small helpers shared by detectors."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
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


# ----- advice from trials -------------------------------------------------------------------------------


def spelled(name: str) -> dict:  # type: ignore[type-arg]
    """What a path's spelling says of it: ``make_fx[detach=alias]+compile:aot_eager`` ->
    ``{"capture": "make_fx", "backend": "aot_eager", "knobs": {"detach": "alias"}, "base": ""}``; a user
    path (``mine[backend=eager]``, a bisection's override ``mine[stance=force_eager]``) has capture
    ``user``, its ``base`` name and, where a knob names it, its ``backend``."""
    out: dict = {"capture": "eager", "backend": None, "knobs": {}, "base": ""}  # type: ignore[type-arg]
    for part in str(name).split("+"):
        head = part.partition("[")[0]
        for group in re.findall(r"\[([^\]]*)\]", part):
            for kv in filter(None, group.split(",")):
                k, _, val = kv.partition("=")
                out["knobs"][k.strip()] = val.strip()
        if head == "make_fx":
            out["capture"] = "make_fx"
        elif head.startswith("compile_model:"):
            out["capture"], out["backend"] = "model", head.removeprefix("compile_model:")
        elif head.startswith("compile:"):
            out["backend"] = head.removeprefix("compile:")
        elif head != "eager":
            out["capture"], out["base"] = "user", head
            out["backend"] = out["knobs"].get("backend")
    return out


@dataclass(frozen=True)
class Candidate:
    """A fix a cause may give: its words, and which paths implement it (a predicate over ``spelled``),
    so that a bisection trial or a path the probe measured can verify or refute it on this model.
    ``partial``: the fix is meant for some scenarios only (compile the model for the first-order terms):
    verified in the scenarios where it matches."""

    text: str
    fits: object = None  # Callable[[dict], bool] | None: None = nothing here can try it
    partial: bool = False


@dataclass
class Advice:
    """Candidate fixes sorted by what was measured: verified (with the trial or path that shows it),
    not tried, and refuted (stated only as the facts that refute them, never suggested)."""

    verified: list[str] = field(default_factory=list)
    untried: list[str] = field(default_factory=list)
    refuted: list[str] = field(default_factory=list)
    claims: list = field(default_factory=list)  # type: ignore[type-arg]

    @property
    def text(self) -> str:
        """The suggestions (verified first, then those not tried), then the refuting facts."""
        out = "; ".join(self.verified + self.untried)
        if self.refuted:
            out += ("; " if out else "") + "refuted here, not suggested: " + "; ".join(self.refuted)
        return out


def family(variant: str) -> Callable[[dict], bool]:  # type: ignore[type-arg]
    """Paths of the same kind as ``variant`` (same capture; for a user path, same base name)."""
    me = spelled(variant)
    return lambda p: p["capture"] == me["capture"] and p["base"] == me["base"]


def advice(
    fm, variant: str, candidates: Iterable[Candidate], scenarios: Iterable[str] | None = None
) -> Advice:  # type: ignore[no-untyped-def]
    """Each candidate fix as what was measured of it on this model, with the claims that show it:

    * a bisection trial of ``variant`` whose path fits the candidate, or a path the probe measured
      (other than ``variant`` and the reference) that fits it, judged on ``scenarios`` (default: the
      runs of ``variant`` that failed or differ);
    * any trial or measured path that does not match the reference refutes it: it is never suggested,
      only the fact is stated ("tried: <change>: <result>");
    * else one that matches verifies it ("verified on this model: <path> matches <reference> in ...");
    * else it is marked "(not tried)".
    """
    from ..claims import claim

    out = Advice()
    bis = fm.bisection(variant) or {}
    trials = list(bis.get("trials") or ())
    if scenarios is None:
        scenarios = [
            s for s in fm.scenario_names if fm.run(variant, s).error is not None or fm.differences(variant, s)
        ]
    scenarios = list(scenarios)
    for c in candidates:
        fits = c.fits
        good: list[tuple[str, object]] = []
        bad: list[tuple[str, object]] = []
        tried_paths = set()
        if callable(fits):
            for t in trials:
                if t.get("knob") == "stance" or not fits(spelled(t.get("variant", ""))):
                    continue
                tried_paths.add(t.get("variant"))
                where = ", ".join(t.get("scenarios") or bis.get("scenarios") or ())
                if t.get("ok"):
                    good.append((
                        f"verified on this model: {t['variant']} matches {fm.reference}"
                        + (f" in {where}" if where else "") + f" (trial: {t.get('change')})",
                        claim("trial", f"trial {t.get('change')}: {t.get('result')}", variant=variant,
                              change=t.get("change"), ok=True),
                    ))  # fmt: skip
                else:
                    bad.append((
                        f"tried: {t.get('change')}: {t.get('result')}",
                        claim("trial", f"trial {t.get('change')}: {t.get('result')}", variant=variant,
                              change=t.get("change"), ok=False),
                    ))  # fmt: skip
            for u in fm.variants:
                if u.name in (variant, fm.reference) or u.name in tried_paths or not fits(spelled(u.name)):
                    continue
                mine = [s for s in scenarios if has_run(fm, u.name, s)]
                ok = [s for s in mine if fm.run(u.name, s).error is None and fm.cells_of(u.name, s)
                      and not fm.differences(u.name, s)]  # fmt: skip
                off = [s for s in mine if s not in ok]
                if ok and (c.partial or not off):
                    good.append((
                        f"verified on this model: {u.name} (measured) matches {fm.reference} in {', '.join(ok)}",
                        claim("matches", f"{u.name} matches {fm.reference} in {', '.join(ok)}",
                              variant=u.name, scenarios=ok),
                    ))  # fmt: skip
                if off and not (c.partial and ok):
                    bad.append((
                        f"measured: {u.name} {measured_words(fm, u.name, off)}",
                        claim("differs", f"{u.name} {measured_words(fm, u.name, off)}", variant=u.name,
                              scenarios=off),
                    ))  # fmt: skip
        if bad:
            out.refuted.extend(text for text, _ in bad)
            out.claims.extend(cl for _, cl in bad)
        elif good:
            out.verified.append(f"{c.text} — " + "; ".join(text for text, _ in good))
            out.claims.extend(cl for _, cl in good)
        else:
            out.untried.append(f"{c.text} (not tried)")
    return out


def measured_words(fm, variant: str, scenarios: list[str]) -> str:  # type: ignore[no-untyped-def]
    """'fails in force only (backward: ...)' / 'differs from eager in force only (lost 10/10: ...)'."""
    failed = [s for s in scenarios if fm.run(variant, s).error is not None]
    wrong = [s for s in scenarios if s not in failed]
    parts = []
    if failed:
        e = fm.run(variant, failed[0]).error
        parts.append(f"fails in {', '.join(failed)} ({e.stage}: {e.type}: {e.message[:160]})")
    if wrong:
        m = fm.mismatch(variant, wrong[0]) or {}
        lost = list(m.get("missing") or ())
        what = [
            f"reaches {m.get('count')}/{len(fm.trainable)} vs {m.get('reference_count')}/{len(fm.trainable)}"
        ]
        if lost:
            what.append(f"lost: {', '.join(lost[:4])}" + (f" (+{len(lost) - 4})" if len(lost) > 4 else ""))
        if m.get("extra"):
            what.append(f"extra: {', '.join(m['extra'][:4])}")
        if m.get("wrong"):
            what.append(f"{len(m['wrong'])} with other values")
        parts.append(f"differs from {fm.reference} in {', '.join(wrong)} ({wrong[0]}: {'; '.join(what)})")
    return " and ".join(parts)


def has_run(fm, variant: str, scenario: str) -> bool:  # type: ignore[no-untyped-def]
    try:
        fm.run(variant, scenario)
    except KeyError:
        return False
    return True


def failure_claims(
    fm, variant: str, failed: list[str], first, contains: str = "", type: str | None = None
) -> list:  # type: ignore[no-untyped-def,type-arg]
    """The facts of a failure signature: which runs (or the build) failed with it, and the user's frame
    the first failure came from."""
    from ..claims import claim

    out = []
    v = fm.variant(variant)
    said = contains or None
    failed = [
        s
        for s in failed
        if (e := fm.run(variant, s).error) is not None and contains in e.message and type in (None, e.type)
    ]
    if failed:
        out.append(claim("run_failed", f"{', '.join(failed)} of {variant} failed: {first.type}"
                         + (f" ('{said}')" if said else ""), variant=variant, scenarios=failed, type=type,
                         contains=contains))  # fmt: skip
    if v.error is not None and contains in v.error.message and (type is None or v.error.type == type):
        out.append(claim("build_failed", f"the build of {variant} failed: {v.error.type}"
                         + (f" ('{said}')" if said else ""), variant=variant, type=type, contains=contains))  # fmt: skip
    at = first.where or {}
    if at.get("file") and at.get("line") is not None:
        if v.error is first or (v.error is not None and v.error == first):
            out.append(claim("build_failed_at", f"the build's failure comes from {where(at)}", variant=variant,
                             file=at["file"], line=at["line"]))  # fmt: skip
        elif failed:
            s0 = next((s for s in failed if fm.run(variant, s).error == first), failed[0])
            out.append(claim("failed_at", f"the failure of {s0} comes from {where(at)}", variant=variant,
                             scenario=s0, file=at["file"], line=at["line"]))  # fmt: skip
    return out
