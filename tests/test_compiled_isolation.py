"""Compiled variants isolate terms (issue 16, items 1-4): a switched-off term is never differentiated,
the model alone can be compiled (``compile_model:<backend>``), failures with a known signature are
named with the user's line, and one variant's config changes do not leak into the next."""

from __future__ import annotations

import os
import textwrap

import torch
from torch import nn

import gradprobe
from gradprobe.variants import parse_variant, user_variant
from gradprobe.zoo import reference_spec


def test_compile_model_trains_the_energy_compiled_and_names_the_double_backward_of_forces():
    fm = gradprobe.probe(reference_spec(), variants="eager,compile_model:aot_eager,compile:aot_eager")
    # The model alone compiled, loss and forces outside: energy only differentiates the energy alone.
    assert fm.run("compile_model:aot_eager", "energy only").error is None
    assert not fm.differences("compile_model:aot_eager", "energy only")
    assert fm.count("compile_model:aot_eager", "energy only") == fm.count("eager", "energy only")
    for s in ("force only", "virial only", "all"):
        assert "double backward" in fm.run("compile_model:aot_eager", s).error.message
    by_variant = {f.evidence["variant"]: f for f in fm.findings if f.cause == "double-backward-unsupported"}
    assert "energy only runs compiled" in by_variant["compile_model:aot_eager"].message
    # The whole step compiled: one joint graph, so even energy only raises — measured, not assumed.
    assert fm.run("compile:aot_eager", "energy only").error is not None
    assert "not separable in this path" in by_variant["compile:aot_eager"].message
    assert fm.variant("compile_model:aot_eager").compile_count == 1


def test_compile_model_is_spelled_parsed_and_bisected_to_the_plain_step():
    v = parse_variant("compile_model:aot_eager[dynamic=false]")
    assert (v.name, v.capture, v.backend, v.knobs) == ("compile_model:aot_eager[dynamic=false]", "model", "aot_eager",
                                                       {"dynamic": False})  # fmt: skip
    from gradprobe.evidence.bisect import with_knobs

    assert with_knobs(v, backend=None).name == "eager" and with_knobs(v, backend=None).capture == "eager"
    assert with_knobs(v, backend="eager").name == "compile_model:eager[dynamic=false]"


def test_a_term_whose_backward_fails_does_not_spoil_the_others():
    # A user path (terms mode) whose second term raises at backward: the first term's scenario,
    # which never differentiates it, is measured.
    torch.manual_seed(0)
    model = nn.Linear(3, 1)

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            return x.clone()

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def]
            raise RuntimeError("this term's backward is broken")

    def step(m, b):  # type: ignore[no-untyped-def]
        y = m(b)
        return {"ok": y.pow(2).mean(), "bad": Boom.apply(y).mean()}

    fm = gradprobe.probe(model, step, torch.randn(4, 3), variants=["eager", "compile:eager"])
    assert fm.run("compile:eager", "ok only").error is None and fm.count("compile:eager", "ok only") == (2, 2)
    assert "broken" in fm.run("compile:eager", "bad only").error.message


SPEC = """
import torch
import gradprobe


class Counted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, x):
        y = self.lin(x)
        n = int(y.sum() > 0)  # reads a value from the data
        return y * (1 + n)


def step(model, batch):
    return {"fit": model(batch).pow(2).mean()}


def spec():
    torch.manual_seed(0)
    return gradprobe.ProbeSpec(model=Counted(), step=step, batch=torch.randn(4, 3), terms=["fit"])
"""


def test_a_data_dependent_trace_is_named_with_the_users_line(tmp_path, capsys):
    from gradprobe.cli import main

    path = tmp_path / "counted.py"
    path.write_text(textwrap.dedent(SPEC))
    assert main(["run", str(path), "--variants", "eager,make_fx"]) == 1
    out = capsys.readouterr().out
    assert "ERROR data-dependent-trace: make_fx cannot be traced" in out
    line = (
        textwrap.dedent(SPEC)
        .splitlines()
        .index("        n = int(y.sum() > 0)  # reads a value from the data")
        + 1
    )
    assert f"counted.py:{line}: n = int(y.sum() > 0)" in out


def test_a_variant_that_changes_compiler_config_does_not_leak_it():
    import torch._dynamo.config as dynamo_config

    before = dynamo_config.recompile_limit
    seen = {}

    def greedy(ctx):  # type: ignore[no-untyped-def]
        dynamo_config.recompile_limit = 1  # a package's compile preparation, globally
        return lambda b, w: (w["fit"] * ctx.model(b).pow(2).mean(), {"fit": ctx.model(b).pow(2).mean()})

    def watcher(ctx):  # type: ignore[no-untyped-def]
        seen["limit"] = dynamo_config.recompile_limit
        return lambda b, w: (w["fit"] * ctx.model(b).pow(2).mean(), {"fit": ctx.model(b).pow(2).mean()})

    model = nn.Linear(3, 1)
    gradprobe.probe(
        model, lambda m, b: {"fit": m(b).pow(2).mean()}, torch.randn(4, 3),
        variants=["eager", user_variant("greedy", greedy), user_variant("watcher", watcher)],
    )  # fmt: skip
    assert seen["limit"] == before and dynamo_config.recompile_limit == before


def test_an_unknown_failure_still_names_the_users_frame():
    def step(m, b):  # type: ignore[no-untyped-def]
        y = m(b)
        return {"fit": y.pow(2).mean()}

    def flaky(ctx):  # type: ignore[no-untyped-def]
        def run(b, w):  # type: ignore[no-untyped-def]
            raise ValueError("the trainer's own bug")  # user frame

        return run

    fm = gradprobe.probe(
        nn.Linear(3, 1), step, torch.randn(4, 3), variants=["eager", user_variant("flaky", flaky)]
    )
    (f,) = fm.errors()
    assert f.cause == "run-failed" and os.path.basename(f.location["file"]) == "test_compiled_isolation.py"
    assert "raise ValueError" in f.location["code"] and "test_compiled_isolation.py:" in f.message


def test_a_double_backward_names_the_line_of_the_create_graph_call():
    # Raised in autograd's engine at gradprobe's own autograd.grad: no user frame in the traceback.
    # Anomaly mode's forward trace of the failing node gives the line that took the create_graph gradient.
    import gradprobe
    from gradprobe.zoo import reference_spec

    fm = gradprobe.probe(reference_spec(), variants="eager,compile_model:aot_eager", progress=False)
    run = fm.run("compile_model:aot_eager", "force only")
    assert run.error is not None and "double backward" in run.error.message
    assert run.error.where is not None and run.error.where["file"].endswith("zoo/potential.py")
    assert "torch.autograd.grad(" in run.error.where["code"] and "create_graph" in run.error.where["code"]
    (f,) = [f for f in fm.findings if f.cause == "double-backward-unsupported"]
    assert "the create_graph gradient is taken at potential.py:" in f.message
    assert f.location["line"] == run.error.where["line"]
    assert fm.run("compile_model:aot_eager", "energy only").error is None  # energy still trains compiled


def test_a_double_backward_in_an_opaque_user_path_names_its_line():
    import gradprobe
    from gradprobe.variants import user_variant

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    x = torch.randn(6, 3)

    def step(model, x):
        x = x.clone().requires_grad_(True)
        e = model(x).sum()
        (g,) = torch.autograd.grad(e, x, create_graph=True)
        return {"e": e.square(), "f": g.square().mean()}

    def compiled_forces(ctx):  # the user's own compile: a plain callable, no graph, no counter, no knobs
        fast = torch.compile(ctx.model, backend="aot_eager")

        def run(x, weights):
            x = x.clone().requires_grad_(True)
            e = fast(x).sum()
            (g,) = torch.autograd.grad(e, x, create_graph=True)  # MY FORCES
            return weights["e"] * e.square() + weights["f"] * g.square().mean()

        return run

    fm = gradprobe.probe(net, step, x, terms=["e", "f"],
                         variants=["eager", user_variant("mine", compiled_forces)], progress=False)  # fmt: skip
    where = fm.run("mine", "f only").error.where
    assert where["file"].endswith("test_compiled_isolation.py") and "# MY FORCES" in where["code"]
    (f,) = [f for f in fm.findings if f.cause == "double-backward-unsupported"]
    assert "# MY FORCES" in f.location["code"]
