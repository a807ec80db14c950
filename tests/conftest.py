import functools
import sys
from collections import Counter
from pathlib import Path

import msgspec
import pytest
import torch

import gradprobe
from gradprobe.zoo import reference_spec

pytest_plugins = ["pytester"]


@functools.cache
def _zoo_map(bug, variants, checks, diagnose):
    return gradprobe.probe(reference_spec(bug=bug), variants=variants, checks=checks, diagnose=diagnose)


@pytest.fixture(scope="session")
def zoo_map():
    """``zoo_map(bug, variants=None, checks=(), diagnose=True)``: a probed zoo spec, computed once per
    session (several test files assert different things about the same, costly, compiled probes)."""

    def get(bug=None, variants=None, checks=(), diagnose=True):
        return _zoo_map(bug, variants, tuple(checks), diagnose)

    return get


@pytest.fixture(autouse=True)
def _fixed_threads():
    # Two cores here: keep timings stable and avoid oversubscription.
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


# ----- the claims audit: every flow map the session makes ----------------------------------------------
# Each diagnosis (``gradprobe.diagnose.diagnose``, through ``probe``, ``merge_maps`` or a test's own call)
# is audited as it is made: every finding's claims re-evaluated on the map's own evidence
# (``gradprobe.claims.audit``). A claim that does not hold, or a finding without claims of a cause not in
# PENDING, fails the session (exit status 1), naming the test that made the map. Findings of the causes
# in PENDING (not converted to claims yet) would be counted and listed, not failed: every cause has claims now.
PENDING: frozenset[str] = frozenset()
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


class _Audit:
    def __init__(self) -> None:
        self.test = "(outside any test)"
        self.maps = self.findings = self.claims = self.loaded_maps = self.loaded_claims = self.foreign = 0
        self.examples: Counter[str] = Counter()
        self.pending: Counter[str] = Counter()
        self.causes: Counter[str] = Counter()  # findings with claims, by cause
        self.problems: list[str] = []

    def loaded(self, fm: gradprobe.FlowMap, diagnose) -> None:
        """A map read back from JSON, made in a subprocess (the distributed ranks, the CLI): audited like
        a map made here when this gradprobe's diagnosis of its evidence gives its findings. An edited,
        damaged or older map (the untrusted-file tests' mutations, saved maps, a subprocess that imported
        another checkout of gradprobe) is not one: only counted."""
        from gradprobe.claims import audit

        if not fm.findings:
            return
        said = [(f.cause, f.severity, f.message, f.claims) for f in fm.findings]
        try:
            ours = [(f.cause, f.severity, f.message, f.claims) for f in diagnose(fm)] == said
        except Exception:
            ours = False
        if not ours:
            self.foreign += 1
            return
        self.loaded_maps += 1
        self.loaded_claims += sum(len(f.claims) for f in fm.findings)
        try:
            problems = audit(fm)
        except Exception as e:
            problems = [f"the audit raised {type(e).__name__}: {e}"]
        for p in problems:
            if not (p.endswith(": no claims") and p.partition(":")[0] in PENDING):
                self.problems.append(f"{self.test} (a map read from JSON): {p}")

    def __call__(self, fm: gradprobe.FlowMap, findings: list[gradprobe.Finding]) -> None:
        from gradprobe.claims import audit

        self.maps += 1
        example = _example_caller()
        if example is not None:
            self.examples[example] += 1
        where = self.test + (f" (examples/{example})" if example else "")
        try:
            full = msgspec.structs.replace(fm, findings=tuple(findings))
            problems = audit(full)
        except Exception as e:  # a predicate that raises is a problem of the claims, not of the test
            problems = [f"the audit raised {type(e).__name__}: {e}"]
        for f in findings:
            self.findings += 1
            self.claims += len(f.claims)
            if f.claims:
                self.causes[f.cause] += 1
        for p in problems:
            cause = p.partition(":")[0]
            if p.endswith(": no claims") and cause in PENDING:
                self.pending[cause] += 1
            else:
                self.problems.append(f"{where}: {p}")


def _example_caller() -> str | None:
    """The script of ``examples/`` on the call stack, if the map is one of theirs."""
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.parent == EXAMPLES:
            return path.name
        frame = frame.f_back
    return None


_AUDIT = _Audit()


def pytest_configure(config):
    import importlib

    # ``gradprobe.diagnose`` is also a function of the package: the modules by their full names.
    diagnosis, probing, distributed = (
        importlib.import_module(f"gradprobe.{m}") for m in ("diagnose", "probe", "distributed")
    )
    original = diagnosis.diagnose

    @functools.wraps(original)
    def diagnose(fm):
        findings = original(fm)
        _AUDIT(fm, findings)
        return findings

    # The module's name and the names bound to it at import (``from .diagnose import diagnose``).
    bound = [(diagnosis, "diagnose"), (probing, "diagnose"), (distributed, "diagnose_map")]
    # Maps read back from JSON, which subprocesses of the tests write.
    flowmap = importlib.import_module("gradprobe.flowmap")
    read = flowmap._from_data

    @functools.wraps(read)
    def from_data(d):
        fm = read(d)
        _AUDIT.loaded(fm, original)
        return fm

    config._claims_audit_restore = [(m, n, getattr(m, n)) for m, n in [*bound, (flowmap, "_from_data")]]
    for module, name in bound:
        setattr(module, name, diagnose)
    flowmap._from_data = from_data


def pytest_unconfigure(config):
    for module, name, value in getattr(config, "_claims_audit_restore", ()):
        setattr(module, name, value)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _AUDIT.test = item.nodeid
    try:
        return (yield)
    finally:
        _AUDIT.test = "(between tests)"


def pytest_sessionfinish(session, exitstatus):
    if _AUDIT.problems and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    a = _AUDIT
    if not a.maps:
        return
    examples = ", ".join(f"{n} from examples/{e}" for e, n in sorted(a.examples.items()))
    pending = sum(a.pending.values())
    line = (
        f"claims audit: {a.maps} flow map(s){f' ({examples})' if examples else ''}, {a.findings} finding(s), "
        f"{a.claims} claim(s); {a.loaded_maps} map(s) read from JSON with {a.loaded_claims} claim(s) (and "
        f"{a.foreign} whose findings this gradprobe does not make of them: edited, damaged or older); "
        f"{len(a.problems)} problem(s); {pending} finding(s) of causes still without claims (PENDING)"
    )
    if a.problems:
        terminalreporter.section("claims audit: FAILED", sep="=", red=True, bold=True)
        for p in a.problems:
            terminalreporter.write_line(p)
    terminalreporter.write_sep("-", line)
    if a.causes:
        terminalreporter.write_line("audited: " + ", ".join(f"{c} ×{n}" for c, n in sorted(a.causes.items())))
    if a.pending:
        terminalreporter.write_line(
            "pending: " + ", ".join(f"{c} ×{n}" for c, n in sorted(a.pending.items()))
        )
