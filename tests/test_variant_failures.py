"""Failure isolation per stage, compile counts and dynamo fallback, user variants, the user's cache."""

import pytest
import torch
from torch import nn
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

import gradprobe
from gradprobe.variants import register_variant, user_variant


class TinyPotential(nn.Module):
    """E = sum_i MLP(x_i); F = -dE/dx with create_graph=self.training, like DeePMD."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.out = nn.Linear(3, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x):
        x = x.detach().requires_grad_(True)
        e = self.out(torch.tanh(self.l2(torch.tanh(self.l1(x))))).sum()
        f = -torch.autograd.grad(e, x, create_graph=self.training)[0]
        return e, f


def step(model, batch):
    e, f = model(batch["x"])
    return {"energy": (e - batch["e"]) ** 2, "force": (f - batch["f"]).pow(2).mean()}


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    model = TinyPotential().double()
    batch = {"x": torch.randn(6, 3, dtype=torch.float64), "e": torch.tensor(0.3, dtype=torch.float64),
             "f": torch.randn(6, 3, dtype=torch.float64)}  # fmt: skip
    return model, batch


def item_step(model, batch):
    terms = step(model, batch)
    scale = batch["x"].abs().max().item()  # make_fx cannot trace a data-dependent value
    return {k: v / scale for k, v in terms.items()}


def test_each_stage_fails_alone_and_the_rest_is_measured(tiny):
    model, batch = tiny

    def failing_builder(ctx):
        raise RuntimeError("trainer could not start")

    def failing_run_builder(ctx):
        def run(batch, weights):
            raise ValueError("bad batch layout")

        return run

    fm = gradprobe.probe(
        model, step, batch,
        variants=[
            "eager", "compile:eager[fullgraph=true]", "compile:aot_eager",
            user_variant("broken-build", failing_builder), user_variant("broken-run", failing_run_builder),
        ],
    )  # fmt: skip
    stages = {
        v: {fm.run(v, s).error.stage for s in fm.scenario_names} for v in fm.variant_names if v != "eager"
    }
    assert stages == {
        "compile:eager[fullgraph=true]": {"compile"},  # autograd.grad cannot be captured in one graph
        "compile:aot_eager": {"backward"},  # double backward through AOTAutograd
        "broken-build": {"build"},
        "broken-run": {"forward"},
    }
    assert fm.variant("broken-build").error.message == "trainer could not start"
    assert fm.run("broken-run", "all").error.type == "ValueError"
    assert fm.count("eager", "force only") == (5, 6)  # out.bias: a constant has no force gradient
    causes = sorted(f.cause for f in fm.findings if f.severity == "error")
    assert causes == ["double-backward-unsupported", "run-failed", "run-failed", "run-failed"]


def test_trace_failure_is_recorded(tiny):
    model, batch = tiny
    fm = gradprobe.probe(model, item_step, batch, variants="eager,make_fx")
    err = fm.variant("make_fx").error
    assert err.stage == "trace" and "_local_scalar_dense" in err.message
    assert all(fm.run("make_fx", s).error == err for s in fm.scenario_names)
    assert fm.run("eager", "all").error is None


CALLS = 0


def recompiling_step(model, batch):
    # Reads a Python global that changes every call: dynamo guards on it and recompiles each time.
    global CALLS
    CALLS += 1
    y = model(batch)
    return {"a": y.pow(2).mean() * (1.0 + 0.0 * CALLS), "b": y.mean().abs()}


def test_dynamo_fallback_past_the_recompile_limit_is_detected():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    with torch._dynamo.config.patch(recompile_limit=1):
        fm = gradprobe.probe(model, recompiling_step, torch.randn(5, 3), variants="eager,compile:eager")
    errors = [fm.run("compile:eager", s).error for s in fm.scenario_names]
    assert errors[0] is None  # the first scenario compiled and ran compiled
    assert [e.type for e in errors[1:]] == ["DynamoFallback"] * 2
    assert "saw no execution of its compiled code" in errors[1].message  # measured, no guessed reason
    assert fm.exit_code == 1


def test_compiled_once_with_tensor_weights_in_weights_mode(tiny):
    model, batch = tiny

    def weights_step(model, batch, weights):
        terms = step(model, batch)
        return weights["energy"] * terms["energy"] + weights["force"] * terms["force"], terms

    fm = gradprobe.probe(
        model, weights_step, batch, terms=["energy", "force"], variants="eager,compile:eager"
    )
    assert fm.variant("compile:eager").compile_count == 1
    assert not any(fm.differences("compile:eager", s) for s in fm.scenario_names)


def test_user_registered_variant(tiny):
    model, batch = tiny

    def build(ctx):
        compiled = torch.compile(ctx.weighted(), backend="eager")
        return lambda batch, weights: compiled(ctx.model, batch, dict(weights))

    register_variant("my-trainer", build)
    fm = gradprobe.probe(model, step, batch, variants="eager,my-trainer")
    assert fm.variant("my-trainer").capture == "user"
    assert not any(fm.differences("my-trainer", s) for s in fm.scenario_names)
    assert fm.count("my-trainer", "force only") == (5, 6)


def graph_breaking_step(model, batch):
    terms = step(model, batch)
    print("", end="")  # a graph break inside the user's own function
    return terms


def test_users_own_step_cache_is_untouched(tiny):
    model, batch = tiny
    gradprobe.probe(model, graph_breaking_step, batch, variants="eager,compile:eager,compile:aot_eager")
    # The step handed to gradprobe is compiled as a copy. (Functions it calls that break the graph
    # themselves are traced as their own frames by dynamo, on their own code objects.)
    assert _debug_get_cache_entry_list(graph_breaking_step.__code__) == []


def test_frozen_trace_is_caught_on_a_second_batch():
    # pre_dispatch make_fx runs autograd.grad at trace time: forces are frozen into the graph. The
    # traced batch looks right; a second batch of the same shapes shows stale force values.
    spec = gradprobe.zoo.reference_spec()
    fm = gradprobe.probe(spec, variants="eager,make_fx[pre_dispatch=true,detach=alias]")
    name = "make_fx[pre_dispatch=true,detach=alias]"
    sb = fm.variant(name).second_batch
    assert sb["scenario"] == "energy only" and set(sb["term_values"]) == {"force", "virial"}
    assert not fm.differences(name, "energy only")
    (finding,) = [f for f in fm.findings if f.cause == "frozen-trace"]
    assert finding.severity == "error" and "term force =" in finding.message


def test_stochastic_ops_warn_when_comparing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 1))
    fm = gradprobe.probe(model, lambda m, b: {"y": m(b).sum()}, torch.randn(5, 3), variants="eager,make_fx")
    assert any("stochastic ops" in w for w in fm.warnings)
    # Every run is reseeded: the traced dropout draws what eager drew.
    assert not fm.differences("make_fx", "y only")


def test_autocast_knob_uses_the_low_precision_tolerance():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1))
    fm = gradprobe.probe(model, lambda m, b: {"y": m(b).pow(2).mean()}, torch.randn(8, 3),
                         variants="eager,eager[autocast=bf16]")  # fmt: skip
    cells = fm.cells_of("eager[autocast=bf16]", "y only").values()
    assert all(c.verdict == "match" for c in cells)
    assert 0 < max(c.rel_error for c in cells) < 5e-2  # bf16 rounding, within its tolerance


@pytest.mark.inductor
def test_inductor_on_the_traced_first_order_graph_matches_eager(tiny):
    model, batch = tiny
    fm = gradprobe.probe(model, step, batch, variants="eager,make_fx[detach=alias]+compile:inductor")
    name = "make_fx[detach=alias]+compile:inductor"
    assert fm.variant(name).compile_count == 1
    cells = [c for s in fm.scenario_names for c in fm.cells_of(name, s).values()]
    assert all(c.verdict == "match" for c in cells)
    assert max(c.rel_error for c in cells if c.rel_error is not None) <= 1e-10
