"""Reliability under hostile steps and hostile moments (issue 36): a step that frees or resizes a
parameter's storage, randomness in a traced step, a step that swaps a module's class, Ctrl-C at any
moment, a fork while another thread probes. What could crash the interpreter or hang runs in a
subprocess with a timeout, so that a failure is a failed test, not a lost test session."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import gradprobe

TESTS = Path(__file__).parent


def run_python(
    code: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (this one's), with the tests folder importable."""
    environ = {**os.environ, **(env or {})}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environ,
    )


def assert_ran(result: subprocess.CompletedProcess, marker: str = "OK") -> None:
    assert result.returncode == 0 and marker in result.stdout, (
        f"exit {result.returncode}\nstdout: {result.stdout[-2000:]}\nstderr: {result.stderr[-3000:]}"
    )


# ---------------------------------------------------------------------------- storage
@pytest.mark.parametrize("size", [0, 4, 1 << 16], ids=["freed", "shrunk", "grown"])
def test_a_step_that_resizes_a_parameters_storage(size):
    # FSDP-style code frees a parameter's storage (resize_(0)); writing the saved values into the freed
    # (or 4-byte) block would corrupt the heap. The storage is put back to its size first.
    result = run_python(
        f"""
        import torch, gradprobe
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        before = {{n: p.detach().clone() for n, p in model.named_parameters()}}
        nbytes = model[0].weight.untyped_storage().nbytes()

        def step(m, x):
            y = m(x)
            terms = {{"a": y[:, 0].square().mean(), "b": y[:, 1].square().mean()}}
            m[0].weight.untyped_storage().resize_({size})
            return terms

        for _ in range(3):
            gradprobe.probe(model, step, torch.randn(5, 3), progress=False)
            assert model[0].weight.untyped_storage().nbytes() == nbytes
            for n, p in model.named_parameters():
                assert torch.equal(p.detach(), before[n]), n
        print("OK")
        """
    )
    assert_ran(result)


def test_a_quantized_buffer_whose_storage_grows():
    result = run_python(
        """
        import torch, gradprobe

        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(3, 2)
                self.register_buffer("table", torch.quantize_per_tensor(torch.rand(64), 0.1, 0, torch.quint8))

            def forward(self, x):
                return self.lin(x) * self.table.dequantize()[:2]

        torch.manual_seed(0)
        model = Model()
        before = model.table.int_repr().clone()

        def step(m, x):
            y = m(x)
            m.table.untyped_storage().resize_(1 << 16)
            return {"a": y.square().mean()}

        for _ in range(3):
            gradprobe.probe(model, step, torch.randn(5, 3), progress=False)
            assert torch.equal(model.table.int_repr(), before)
        print("OK")
        """
    )
    assert_ran(result)


def test_a_lone_parameter_on_read_only_memory_is_never_written(tmp_path):
    # Values the step left alone are compared, not written back: a parameter on read-only pages (a
    # read-only memory map) survives the probe.
    path = tmp_path / "weights.npy"
    np.save(path, np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32))
    result = run_python(
        f"""
        import warnings
        import numpy as np, torch, gradprobe
        pages = np.load({str(path)!r}, mmap_mode="r")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns that the array is not writable
            weight = torch.nn.Parameter(torch.from_numpy(pages))
        model = torch.nn.Module()
        model.weight = weight

        def step(m, x):
            return {{"fit": (x @ m.weight.t()).square().mean()}}

        fm = gradprobe.probe(model, step, torch.randn(5, 3), progress=False)
        assert fm.count("eager", "fit only") == (1, 1)
        print("OK")
        """
    )
    assert_ran(result)


# ---------------------------------------------------------------------------- randomness in the step
@pytest.mark.parametrize("source", ["python", "numpy", "torch"])
def test_a_traced_step_draws_what_the_reference_drew(source):
    # A step that draws from an RNG (a random subsample, a random rotation): the make_fx trace runs the
    # step once, and it must draw the numbers the eager reference drew, whatever the user's RNG state
    # before the probe, or the report blames make_fx for randomness.
    def draw() -> float | torch.Tensor:
        if source == "python":
            return random.random()
        if source == "numpy":
            return float(np.random.rand())
        return torch.rand(())  # a random op the traced graph runs again, from the seeded generator

    def step(m, x):
        scale = 0.5 + draw()  # a Python number: the trace keeps the value it drew
        y = m(x) * scale
        return {"a": y[:, 0].square().mean(), "b": y[:, 1].square().mean()}

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(6, 3)
    for state in (1, 2):
        random.seed(state)
        np.random.seed(state)
        torch.manual_seed(state)
        fm = gradprobe.probe(model, step, x, variants="eager,make_fx", progress=False)
        for s in fm.scenario_names:
            assert fm.differences("make_fx", s) == {}, (state, s)
        assert not fm.errors(), [f.cause for f in fm.findings]


# ---------------------------------------------------------------------------- module classes
class Symmetric(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.triu() + w.triu(1).transpose(-1, -2)


def test_a_parametrization_the_step_registers_is_removed():
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    weight = model[0].weight
    x = torch.randn(4, 3)
    expected = model(x)

    def step(m, b):
        if not parametrize.is_parametrized(m[0]):
            parametrize.register_parametrization(m[0], "weight", Symmetric())
        return {"fit": m(b).square().mean()}

    gradprobe.probe(model, step, x, progress=False)
    assert type(model[0]) is nn.Linear and model[0].weight is weight
    assert not parametrize.is_parametrized(model[0])
    assert torch.equal(model(x), expected)


def test_a_parametrization_the_step_removes_is_put_back():
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    parametrize.register_parametrization(model[0], "weight", Symmetric())
    cls = type(model[0])
    x = torch.randn(4, 3)
    expected = model(x)

    def step(m, b):
        y = m(b)
        if parametrize.is_parametrized(m[0]):
            parametrize.remove_parametrizations(m[0], "weight")
        return {"fit": y.square().mean()}

    gradprobe.probe(model, step, x, progress=False)
    assert type(model[0]) is cls and parametrize.is_parametrized(model[0], "weight")
    assert torch.equal(model(x), expected)  # forward works: the class and its parametrizations are back


# ---------------------------------------------------------------------------- Ctrl-C
SIGINT_SCRIPT = """
import os, random, signal, sys, threading, time
import numpy as np, torch, gradprobe
from messy_model import Messy
from test_state import snapshot, assert_same

variants, rounds, longest = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
# Python's own Ctrl-C, whatever this process inherited (a CI step run in the background ignores SIGINT).
signal.signal(signal.SIGINT, signal.default_int_handler)
torch.manual_seed(0)
model = Messy()
model.inp.weight.grad = torch.ones_like(model.inp.weight)
batch = torch.randn(16, 3)

def step(m, b):
    a, c = m(b)
    with torch.no_grad():
        m.head_a.bias.add_(1.0)  # side effects the restore must undo
    m.train()
    return {"a": a.pow(2).mean(), "b": c.pow(2).mean()}

# Once before the rounds: a first make_fx or compile imports much of torch, and Ctrl-C in the middle
# of an import leaves that module half imported for the rest of the process (Python's behaviour).
gradprobe.probe(model, step, batch, terms=["a", "b"], variants=variants, progress=False)
pick = random.Random(1234)
interrupted = lost = 0
for k in range(rounds):
    before = snapshot(model)
    delay = pick.uniform(0.0, longest)
    timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
    got = False
    try:
        timer.start()
        gradprobe.probe(model, step, batch, terms=["a", "b"], variants=variants, progress=False)
        time.sleep(longest + 0.05)  # an interrupt that arrives after the probe lands here
    except KeyboardInterrupt:
        got = True
    timer.join()
    interrupted += got
    lost += not got
    assert_same(before, snapshot(model))
print("interrupted", interrupted, "lost", lost)
assert lost == 0
print("OK")
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("variants", "rounds", "longest"),
    [("eager", 40, 0.03), ("eager,make_fx", 12, 0.3), ("eager,compile:eager", 6, 1.5)],
    ids=["eager", "make_fx", "compiled"],
)
def test_real_sigint_at_random_moments_is_never_lost_and_never_half_restores(variants, rounds, longest):
    result = run_python(
        f"import sys; sys.argv[1:] = {[variants, str(rounds), str(longest)]!r}\n" + SIGINT_SCRIPT, timeout=300
    )
    assert_ran(result)


def test_a_process_that_ignores_sigint_keeps_ignoring_it_during_a_probe():
    """nohup, or a background job of a script, starts a process with SIGINT ignored: a Ctrl-C during a
    probe must not become a KeyboardInterrupt there."""
    result = run_python(
        """
        import os, signal, threading
        import torch, gradprobe

        signal.signal(signal.SIGINT, signal.SIG_IGN)
        hit = threading.Event()

        def step(m, x):
            if not hit.is_set():
                hit.set()
                os.kill(os.getpid(), signal.SIGINT)  # inside the probe
                signal.raise_signal(signal.SIGINT)
            return {"fit": m(x).square().mean()}

        fm = gradprobe.probe(torch.nn.Linear(3, 1), step, torch.ones(2, 3), progress=False)
        assert hit.is_set() and fm.count("eager", "fit only") == (2, 2)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        print("OK")
        """,
        timeout=120,
    )
    assert_ran(result)


# ---------------------------------------------------------------------------- fork
def test_a_pool_forked_while_another_thread_probes_does_not_hang():
    result = run_python(
        """
        import multiprocessing, threading, time
        import torch, gradprobe

        started = threading.Event()

        def slow_step(m, x):
            started.set()
            time.sleep(1.0)  # holds the probe lock while the main thread forks
            return {"fit": m(x).square().mean()}

        def child_probe(_):
            fm = gradprobe.probe(torch.nn.Linear(3, 1), lambda m, x: {"fit": m(x).square().mean()}, torch.ones(2, 3), progress=False)
            return fm.count("eager", "fit only")

        thread = threading.Thread(target=gradprobe.probe, args=(torch.nn.Linear(3, 1), slow_step, torch.ones(2, 3)), kwargs={"progress": False})
        thread.start()
        started.wait()
        with multiprocessing.get_context("fork").Pool(2) as pool:
            counts = pool.map(child_probe, range(2))
        thread.join()
        assert counts == [(2, 2), (2, 2)], counts
        print("OK")
        """,
        timeout=60,
    )
    assert_ran(result)


# ---------------------------------------------------------------------------- the environment
def test_dynamo_disabled_by_the_environment_is_named_as_such_and_nothing_else():
    result = run_python(
        """
        import torch, gradprobe
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))

        def step(m, b):
            y = m(b)
            return {"a": y.pow(2).mean(), "b": m[0].weight.abs().sum()}

        fm = gradprobe.probe(model, step, torch.randn(5, 3), variants="eager,compile:eager", progress=False)
        print([f.cause for f in fm.findings if f.severity != "info"])
        print(fm.findings[0].message)
        """,
        env={"TORCHDYNAMO_DISABLE": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    causes, message = result.stdout.splitlines()[:2]
    assert causes == "['dynamo-disabled']"
    assert message.startswith("TORCHDYNAMO_DISABLE=1 is set in the environment: nothing was compiled")


def test_a_crash_of_gradprobe_itself_exits_3_with_one_line():
    # TORCH_LOGS=bogus makes torch's own import fail: not a finding (1) nor a usage error (2).
    command = [sys.executable, "-c", "import sys, _gradprobe_cli; sys.exit(_gradprobe_cli.main())"]
    env = {**os.environ, "TORCH_LOGS": "bogus"}
    quiet = subprocess.run([*command, "demo"], capture_output=True, text=True, env=env, timeout=120)
    assert quiet.returncode == 3, quiet.stderr
    lines = quiet.stderr.strip().splitlines()
    assert lines[0].startswith("gradprobe: internal error: ValueError: Invalid log settings: bogus")
    assert "-v for the traceback" in lines[1] and "Traceback" not in quiet.stderr and len(lines) == 2
    loud = subprocess.run([*command, "-v", "demo"], capture_output=True, text=True, env=env, timeout=120)
    assert loud.returncode == 3 and "Traceback" in loud.stderr


def test_a_crash_inside_the_command_exits_3(monkeypatch, capsys):
    from gradprobe import cli

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug in gradprobe")

    monkeypatch.setattr(cli, "_report", broken)
    assert cli.main(["demo", "-q"]) == 3
    err = capsys.readouterr().err
    assert (
        err.startswith("gradprobe: internal error: ZeroDivisionError: a bug in gradprobe")
        and "Traceback" not in err
    )


def test_fake_parameters_are_refused_with_the_fix():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = nn.Linear(3, 1)
        batch = torch.randn(4, 3)
    with pytest.raises(gradprobe.SpecError, match=r"weight is a FakeTensor .* built outside FakeTensorMode"):
        gradprobe.probe(model, lambda m, b: {"a": m(b).sum()}, batch, progress=False)


def test_a_model_nested_past_the_recursion_limit_is_refused_with_the_fix():
    # Deeper than the recursion limit in force (a package imported earlier may have raised it): torch's
    # own module walk, or the step's forward, fails; either way one GradProbeError, never a raw one.
    model: nn.Module = nn.Linear(3, 3)
    for _ in range(sys.getrecursionlimit() + 200):
        model = nn.Sequential(model)
    with pytest.raises(gradprobe.GradProbeError, match="recursion"):
        gradprobe.probe(model, lambda m, b: {"a": m(b).sum()}, torch.randn(4, 3), progress=False)
