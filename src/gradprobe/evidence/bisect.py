"""Bisection: from a variant that breaks the flow to the first knob whose flip restores it.

A user variant (a trainer adapter's configuration) flips the knobs it declares, in their order.
Otherwise, one flip at a time: the capture stage (``make_fx`` + compile → ``make_fx`` alone; a direct
compile → eager), then — at the stage that breaks — detach handling, module mode, ``pre_dispatch``,
``tracing_mode``, autocast; where the capture alone is fine, ``dynamic``/``fullgraph`` and then the
backend ladder ``eager`` → ``aot_eager`` → ``aot_eager_decomp_partition`` (→ ``inductor``, or the
variant's own backend). A backend is never blamed for what flipping detach handling fixes: the
capture stage is tested first, and a compile ladder is only climbed on a capture that is right.

A trial's ``ok`` is the check's (``collect.bisect_failing``): the flow matches the reference in reach
and value on the failing scenario and on every other scenario measured after it. A fix is "verified"
in the summary only on such a trial; a fix trial that does not match is said so.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..progress import stage
from ..variants import BACKENDS, VariantSpec, canonical_name

# (ok, one-line result) for a variant measured on the failing scenarios; a check may add a third item,
# a dict merged into the trial's record (how its time split, whether a result or a trace was reused).
Check = Callable[[VariantSpec], tuple[Any, ...]]

LADDER = ("eager", "aot_eager", "aot_eager_decomp_partition")


@dataclass
class Bisection:
    variant: str
    scenarios: list[str]
    trials: list[dict[str, Any]] = field(default_factory=list)
    culprit: dict[str, Any] | None = None
    irrelevant: list[str] = field(default_factory=list)
    stage: str = ""
    fix: dict[str, Any] | None = None
    summary: str = ""
    not_overridable: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "variant": self.variant,
            "scenarios": self.scenarios,
            "trials": self.trials,
            "culprit": self.culprit,
            "irrelevant": self.irrelevant,
            "stage": self.stage,
            "fix": self.fix,
            "summary": self.summary,
            "not_overridable": self.not_overridable,
        }


def with_knobs(
    v: VariantSpec, capture: str | None = None, backend: Any = "same", **changes: Any
) -> VariantSpec:
    """A copy of ``v`` with another capture/backend and knobs changed (``None`` value = default)."""
    capture = capture or v.capture
    backend = v.backend if backend == "same" else backend
    if capture == "model" and backend is None:
        capture = "eager"  # the model without its compile is the plain step
    knobs = {k: val for k, val in {**v.knobs, **changes}.items() if val is not None}
    from ..variants import COMPILE_KNOBS, MAKE_FX_KNOBS, STEP_KNOBS

    allowed = dict(STEP_KNOBS)
    if capture == "make_fx":
        allowed.update(MAKE_FX_KNOBS)
    if backend is not None:
        allowed.update(COMPILE_KNOBS)
    knobs = {k: val for k, val in knobs.items() if k in allowed and val != allowed[k][0]}
    return VariantSpec(canonical_name(capture, backend, knobs), capture, backend, knobs)


def bisect(failing: VariantSpec, scenarios: list[str], check: Check, model_training: bool) -> Bisection:
    """Flip one knob at a time and name the first flip that restores the flow."""
    b = Bisection(failing.name, scenarios)

    def trial(knob: str, change: str, v: VariantSpec) -> bool:
        with stage(f"{failing.name}: trial {len(b.trials) + 1} ({change})"):
            start = time.perf_counter()
            got = check(v)
            seconds = time.perf_counter() - start
        ok, result = got[0], got[1]
        # Each trial's wall time is recorded: bisection is most of what diagnose=True costs (issue 20).
        entry = {"knob": knob, "change": change, "variant": v.name, "ok": ok, "result": result,
                 "seconds": round(seconds, 4)}  # fmt: skip
        if len(got) > 2:
            entry.update(got[2])
        b.trials.append(entry)
        return ok

    base = failing
    if failing.capture == "user":
        b.stage = failing.base or failing.name
        _user_flips(b, failing, trial)
        if b.culprit is None and failing.builder is not None:
            _generic_flips(b, failing, trial)
        return _summarise(b, failing)
    if failing.capture == "make_fx" and failing.compiled:
        alone = with_knobs(failing, backend=None)
        if trial("capture", f"{failing.name} → {alone.name} (no compile)", alone):
            b.stage = "compile"
            _ladder(b, failing, trial)
            return _summarise(b, failing)
        b.stage = "make_fx"
        base = alone
    elif failing.capture in ("eager", "model") and failing.compiled:
        plain = with_knobs(failing, backend=None)
        if trial("capture", f"{failing.name} → {plain.name} (no compile)", plain):
            b.stage = "compile"
            _ladder(b, failing, trial)
            if b.culprit is not None and failing.capture == "eager":
                # The pattern that works for second-order terms: trace, decompose detach, compile first order.
                fix = with_knobs(failing, capture="make_fx", detach="alias")
                b.fix = {"variant": fix.name, "ok": trial("fix", f"{failing.name} → {fix.name}", fix)}
            return _summarise(b, failing)
        b.stage = "eager"
        base = plain
    else:
        b.stage = failing.capture

    for knob, change, flipped in _flips(base, model_training):
        if trial(knob, change, flipped):
            if b.culprit is None:
                b.culprit = {"knob": knob, "change": change}
        else:
            b.irrelevant.append(knob)
    if b.culprit is not None and failing.compiled:
        knob = b.culprit["knob"]
        value = next(t["variant"] for t in b.trials if t["knob"] == knob)
        fixed = with_knobs(failing, **_knob_values(value, knob))
        b.fix = {"variant": fixed.name, "ok": trial("fix", f"{failing.name} → {fixed.name}", fixed)}
    elif b.culprit is not None:
        b.fix = {"variant": next(t["variant"] for t in b.trials if t["ok"]), "ok": True}
    return _summarise(b, failing)


def _user_flips(b: Bisection, failing: VariantSpec, trial: Callable[[str, str, VariantSpec], bool]) -> None:
    """A user variant (a trainer's own compiled path): flip each of its declared knobs to each other
    allowed value, one at a time from the failing setting, in the order declared; the first flip that
    restores the flow is the culprit and its variant the verified fix. It stops there: each trial of a
    trainer's configuration may be a full compile (minutes with inductor).

    Cheapest backend first: when the path declares a ``backend`` knob set to an expensive backend and
    allows a cheaper one (``eager`` < ``aot_eager`` < ``aot_eager_decomp_partition`` < ``inductor``),
    the first trial is that cheaper backend. If it restores the flow, the backend is the culprit; if the
    failure reproduces there, the other knobs are flipped on it (cheap trials) and the fix found is
    verified once on the path's own backend."""
    from ..variants import spell, with_user_knobs

    base = failing
    cheap = _cheaper_backend(failing)
    if cheap is not None:
        current = failing.knob("backend")
        change = f"backend={spell(current)} → {spell(cheap)}"
        on_cheap = with_user_knobs(failing, backend=cheap)
        if trial("backend", change + " (cheapest first)", on_cheap):
            b.culprit = {"knob": "backend", "change": change}
            b.fix = {"variant": on_cheap.name, "ok": True}
            return
        base = on_cheap  # it fails on the cheap backend too: bisect there
        b.irrelevant.append("backend")
    for knob, (_default, allowed) in failing.user_knobs.items():
        if knob == "backend" and base is not failing:
            continue
        current = base.knob(knob)
        for value in allowed:
            if value == current:
                continue
            change = f"{knob}={spell(current)} → {spell(value)}"
            flipped = with_user_knobs(base, **{knob: value})
            if trial(knob, change, flipped):
                b.culprit = {"knob": knob, "change": change}
                if base is failing:
                    b.fix = {"variant": flipped.name, "ok": True}
                else:  # found on the cheap backend: verified once on the path's own
                    fixed = with_user_knobs(failing, **{knob: value})
                    b.fix = {
                        "variant": fixed.name,
                        "ok": trial("fix", f"{failing.name} → {fixed.name}", fixed),
                    }
                return
        b.irrelevant.append(knob)


_COST = {name: i for i, name in enumerate(BACKENDS)}  # eager, aot_eager, aot_eager_decomp_partition, inductor


def _cheaper_backend(v: VariantSpec) -> Any:
    """The cheapest value of a user knob named ``backend`` below its current one, if both are known
    backends; else None."""
    if "backend" not in v.user_knobs:
        return None
    current = v.knob("backend")
    allowed = [a for a in v.user_knobs["backend"][1] if a in _COST]
    if current not in _COST or not allowed:
        return None
    cheapest = min(allowed, key=_COST.__getitem__)
    return cheapest if _COST[cheapest] < _COST[current] else None


def _generic_flips(
    b: Bisection, failing: VariantSpec, trial: Callable[[str, str, VariantSpec], bool]
) -> None:
    """A path whose own knobs (if any) do not restore the flow: flips that need no cooperation.

    First the ``force_eager`` stance: if the flow comes back with compiled code off, the break is in
    compilation; then the path is rebuilt with every ``torch.compile()`` its builder calls overridden
    along the backend ladder, and the first rung that breaks is the culprit (the path's own backend
    when every rung is fine). A builder that calls no ``torch.compile()`` cannot be overridden.
    """
    from .overrides import under_force_eager, with_backend

    if not trial("stance", "compiled code off (force_eager stance)", under_force_eager(failing)):
        b.stage = "python"
        b.irrelevant.append("compilation")
        return
    b.stage = "compile"
    last_good = None
    for rung in LADDER:
        calls = [0]
        ok = trial("backend", f"backend → {rung} (override)", with_backend(failing, rung, calls))
        if calls[0] == 0:
            b.trials[-1]["result"] += "; not overridable: the builder called no torch.compile()"
            b.not_overridable = True
            return
        if not ok:
            b.culprit = {"knob": "backend", "change": f"backend {last_good or '(none)'} → {rung}",
                         "backend": rung, "last_good": last_good, "ladder": True}  # fmt: skip
            break
        last_good = rung
    else:
        b.culprit = {"knob": "backend", "change": f"backend {last_good} → the path's own",
                     "backend": "the path's own backend", "last_good": last_good, "ladder": True}  # fmt: skip
    if last_good is not None:
        variant = next(t["variant"] for t in b.trials if t["variant"].endswith(f"[backend={last_good}]"))
        b.fix = {"variant": variant, "ok": True}


def _knob_values(variant_name: str, knob: str) -> dict[str, Any]:
    from ..variants import parse_variant

    return {knob: parse_variant(variant_name).knob(knob)}


def _flips(base: VariantSpec, model_training: bool) -> list[tuple[str, str, VariantSpec]]:
    flips = []
    if base.capture == "make_fx" and base.knob("detach") == "keep":
        flips.append(("detach", "detach=keep → alias", with_knobs(base, detach="alias")))
    mode = base.knob("mode")
    current = mode if mode != "as-is" else ("train" if model_training else "eval")
    other = "eval" if current == "train" else "train"
    flips.append(("mode", f"mode={current} → {other}", with_knobs(base, mode=other)))
    if base.capture == "make_fx" and base.knob("pre_dispatch"):
        flips.append(("pre_dispatch", "pre_dispatch=true → false", with_knobs(base, pre_dispatch=False)))
    if base.capture == "make_fx" and base.knob("tracing_mode") == "symbolic":
        flips.append(("tracing_mode", "tracing_mode=symbolic → real", with_knobs(base, tracing_mode="real")))
    if base.knob("autocast") != "off":
        flips.append(
            ("autocast", f"autocast={base.knob('autocast')} → off", with_knobs(base, autocast="off"))
        )
    return flips


def _ladder(b: Bisection, failing: VariantSpec, trial: Callable[[str, str, VariantSpec], bool]) -> None:
    """The capture is right: flip compile knobs, then climb the backend ladder to the first that breaks."""
    for knob in ("dynamic", "fullgraph"):
        if knob in failing.knobs:
            flipped = with_knobs(failing, **{knob: None})
            if trial(knob, f"{knob}={failing.knobs[knob]} → default", flipped):
                b.culprit = {"knob": knob, "change": f"{knob}={failing.knobs[knob]} → default"}
                return
            b.irrelevant.append(knob)
    ladder = list(LADDER) + (["inductor"] if failing.backend == "inductor" else [])
    if failing.backend not in ladder:
        ladder.append(failing.backend)  # a custom backend goes last
    last_good = None
    for backend in ladder:
        v = with_knobs(failing, backend=backend)
        if not trial("backend", f"backend → {backend}", v):
            b.culprit = {"knob": "backend", "change": f"backend {last_good or '(none)'} → {backend}",
                         "backend": backend, "last_good": last_good, "ladder": True}  # fmt: skip
            return
        last_good = backend
        if backend == failing.backend:
            return


def _summarise(b: Bisection, failing: VariantSpec) -> Bisection:
    parts = []
    stance = next((t for t in b.trials if t["knob"] == "stance"), None)
    if stance is not None:
        parts.append(
            "with compiled code off (force_eager) the flow is right: the break is in compilation"
            if stance["ok"]
            else "with compiled code off (force_eager) the flow is still broken: the break is in the path's "
            "Python or its traced graph, not in compilation"
        )
    if b.not_overridable:
        parts.append(
            "the backend is not overridable: the path's builder called no torch.compile() (wrapped earlier)"
        )
    capture = next((t for t in b.trials if t["knob"] == "capture"), None)
    if capture is not None:
        if b.stage == "compile":
            parts.append(
                f"without compile ({capture['variant']}) the flow is right: the break is in compilation"
            )
        else:
            parts.append(f"{capture['variant']} alone already breaks it; the compile backend does not matter")
    if b.culprit is not None:
        if b.culprit.get("ladder"):  # a rung of the backend ladder (a user knob may be named backend too)
            last = b.culprit.get("last_good")
            parts.append(
                f"first backend that breaks it: {b.culprit['backend']}"
                + (f" (last good: {last})" if last else "")
            )
        else:
            parts.append(f"flipping {b.culprit['change']} restores the flow")
    elif b.trials:
        parts.append("no single flip restores the flow")
    if b.irrelevant:
        parts.append(f"flipping {', '.join(b.irrelevant)} alone does not restore it")
    if b.fix is not None:
        # A fix is verified only by a trial whose flow matches the reference in reach and value in every
        # scenario it measured (``collect.bisect_failing``): one that also removes a cut the reference
        # has (the user's own detach()) gives gradients the reference does not have, and is not.
        parts.append(
            f"fix verified: {b.fix['variant']} matches the reference"
            if b.fix["ok"]
            else f"fix tried: {b.fix['variant']} does not match the reference"
        )
    b.summary = "; ".join(parts)
    return b


__all__ = ["BACKENDS", "LADDER", "Bisection", "bisect", "with_knobs"]
