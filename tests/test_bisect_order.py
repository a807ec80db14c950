"""Bisection of the built-in variants goes cheapest first (issue 20): the capture without a compile,
then the backend ladder from ``eager`` up; an expensive backend (inductor) is compiled at most once,
to confirm. The check here is a plain function of the variant: the order is the bisector's, no compile
runs."""

from gradprobe.evidence.bisect import bisect
from gradprobe.variants import parse_variants

COST = {None: 0, "eager": 1, "aot_eager": 2, "aot_eager_decomp_partition": 3, "inductor": 4}


def _run(spelling: str, ok) -> tuple[list, dict]:
    (failing,) = parse_variants(spelling)
    tried = []

    def check(v):
        tried.append(v)
        good = ok(v)
        return good, "ok" if good else "broken"

    return tried, bisect(failing, ["force only"], check, model_training=True).to_dict()


def test_a_backend_failure_climbs_the_ladder_from_the_cheapest():
    tried, b = _run("make_fx[detach=alias]+compile:inductor", lambda v: v.backend != "inductor")
    costs = [COST[v.backend] for v in tried]
    assert costs == sorted(costs), [v.name for v in tried]  # never back to a dearer backend
    assert [v.backend for v in tried].count("inductor") == 1 and tried[-1].backend == "inductor"
    assert b["culprit"]["knob"] == "backend" and b["culprit"]["backend"] == "inductor"


def test_a_capture_failure_is_bisected_without_compiling_and_confirmed_once():
    # make_fx drops the gradients whatever the backend (makefx-detach): every flip is tried on the
    # trace alone; the one compile is the verification of the fix on the path's own backend.
    tried, b = _run("make_fx+compile:inductor", lambda v: v.knobs.get("detach") == "alias")
    compiled = [v for v in tried if v.backend is not None]
    assert [v.backend for v in compiled] == ["inductor"] and tried[-1] is compiled[0]
    assert b["culprit"]["knob"] == "detach" and b["fix"]["ok"]


def test_a_direct_compile_on_inductor_compiles_inductor_once_to_confirm_the_fix():
    # compile:inductor breaks the flow, the capture without compile and every cheaper rung do not. The
    # ladder's inductor rung is the failing variant itself: the probe's own run of it is re-used
    # (evidence.collect), so the one inductor compile is the verification of the fix.
    from gradprobe.evidence.collect import _same_path

    (failing,) = parse_variants("compile:inductor")
    tried, b = _run("compile:inductor", lambda v: v.backend != "inductor" or v.capture == "make_fx")
    costs = [COST[v.backend] for v in tried]
    assert costs == sorted(costs), [v.name for v in tried]
    on_inductor = [v for v in tried if v.backend == "inductor"]
    assert len(on_inductor) == 2 and _same_path(on_inductor[0], failing)
    assert on_inductor[1].name == "make_fx[detach=alias]+compile:inductor" and b["fix"]["ok"]
    assert b["culprit"]["backend"] == "inductor" and b["culprit"]["last_good"] == "aot_eager_decomp_partition"
