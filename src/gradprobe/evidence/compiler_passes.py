"""Inside the backend that breaks the flow: torch's own ``CompilerBisector``, handed the failing path.

When the backend ladder names ``aot_eager_decomp_partition`` or ``inductor`` (or, for a path that
declares no knobs, its own backend past every override rung) as the first backend that changes the
gradients, ``torch._inductor.compiler_bisector.CompilerBisector.do_bisect`` can go further: it climbs
the backends again, then switches that backend's subsystems off one at a time (decompositions, pre-/
post-grad and joint-graph passes, lowerings, config changes such as ``fallback_random``) and bisects
the number of applications, naming e.g. "decomposition #4: aten.native_dropout". Every trial is a full
rebuild and compile with dynamo reset and compiler caches off (an inductor trial is a cold compile:
a minute or more on a big model), so this is opt-in: ``probe(..., compiler_bisect=True)`` or
``--compiler-bisect``. Its trials and time are reported.

The path is rebuilt per trial; a path wrapped by ``torch.compile`` at import time is not reached by
the backend switch (the bisection reports it "not overridable" before this runs and nothing is handed).
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..progress import stage
from ..wording import op_name

# Backends whose subsystems CompilerBisector knows (the others have none to switch off).
WITH_SUBSYSTEMS = ("aot_eager_decomp_partition", "inductor")

_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("gradprobe_compiler_bisect", default=False)


@contextlib.contextmanager
def enabled(on: bool) -> Iterator[None]:
    """Within: bisections of a failing backend are handed to CompilerBisector (opt-in: costly)."""
    token = _ENABLED.set(on)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def wanted() -> bool:
    return _ENABLED.get()


def available() -> bool:
    try:
        from torch._inductor.compiler_bisector import CompilerBisector  # noqa: F401
    except ImportError:  # torch < 2.6
        return False
    return True


def bisect_passes(name: str, trial: Callable[[], bool]) -> dict[str, Any]:
    """``CompilerBisector.do_bisect(trial)``; ``trial()`` rebuilds and measures the path, True when
    its gradients match the reference. Plain data for the flow map."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compiler_bisector import CompilerBisector

    trials: list[dict[str, Any]] = []

    def one() -> bool:
        torch._dynamo.reset()  # compiled code of an earlier trial must not be reused
        backend, subsystem = CompilerBisector.get_backend(), CompilerBisector.get_subsystem()
        with stage(f"{name}: compiler bisection trial {len(trials) + 1} ({backend}, {subsystem or 'whole'})"):
            try:
                ok = bool(trial())
            except Exception as e:  # a trial that raises is a bad one (the bisector needs a verdict)
                ok = False
                trials.append(
                    {
                        "backend": backend,
                        "subsystem": subsystem,
                        "ok": ok,
                        "error": f"{type(e).__name__}: {e}"[:300],
                    }
                )
                return ok
        trials.append({"backend": backend, "subsystem": subsystem, "ok": ok})
        return ok

    start = time.perf_counter()
    log = io.StringIO()  # the bisector prints its progress; kept for the record, not on the user's stdout
    try:
        with (
            inductor_config.patch(force_disable_caches=True),
            contextlib.redirect_stdout(log),
            warnings.catch_warnings(),  # "dynamo_pgo force disabled by force_disable_caches", per trial
        ):
            warnings.simplefilter("ignore")
            result = CompilerBisector.do_bisect(one)
    except Exception as e:  # its own failure is recorded; the rest of the diagnosis stands
        return {
            "error": f"{type(e).__name__}: {e}"[:300],
            "trials": trials,
            "seconds": time.perf_counter() - start,
        }
    finally:
        torch._dynamo.reset()
    out: dict[str, Any] = {
        "trials": trials,
        "seconds": time.perf_counter() - start,
        "log": log.getvalue().splitlines()[-20:],
    }
    if result is None:
        out["result"] = None  # every backend was fine when rebuilt: not reproducible this way
        return out
    out["result"] = {
        "backend": result.backend,
        "subsystem": result.subsystem,
        "bisect_number": result.bisect_number,
        "debug_info": result.debug_info,
    }
    return out


def describe(found: dict[str, Any]) -> str:
    """'compiler bisection (11 trials, 3.0 s): the first bad backend is aot_eager_decomp_partition,
    subsystem decomposition (application #4: aten.native_dropout)'."""
    head = f"compiler bisection ({len(found.get('trials') or ())} trials, {found.get('seconds', 0):.1f} s)"
    if found.get("error"):
        return f"{head} failed: {found['error']}"
    r = found.get("result")
    if r is None:
        return f"{head}: every backend was right when the path was rebuilt (not reproduced)"
    text = f"{head}: the first bad backend is {r['backend']}"
    if not r.get("subsystem"):
        return text + " (no single subsystem of it is to blame)"
    text += f", subsystem {r['subsystem']}"
    if r.get("bisect_number"):
        info = op_name(r.get("debug_info"))
        text += f" (application #{r['bisect_number']}" + (f": {info})" if info else ")")
    return text
