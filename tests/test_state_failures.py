"""State safety under failure: whatever goes wrong inside a probe, the user's world is as it was.

An exception in the user's step, a variant that fails to compile, and a ``KeyboardInterrupt`` at any
stage (eager forward, a weights-mode scenario, dynamo tracing, a backward, make_fx tracing, the
locator's instrumented run, the training check, the second-batch check) leave the model, its
``.grad`` objects, ``requires_grad`` flags, modes, hooks, buffers, the RNG streams and every global
torch setting exactly as they were. A ``KeyboardInterrupt`` propagates; it is never recorded as a
failed run. The user's own step never gets a dynamo cache entry from gradprobe's compiles.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch._dynamo
import torch._inductor.config
import torch.nn.modules.module as module_globals
from messy_model import Messy
from torch import nn
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.overrides import _get_current_function_mode_stack

import gradprobe
from gradprobe import process_state

CONFIG_MODULES = [sys.modules[name] for name in process_state.CONFIG_MODULES if name in sys.modules]
GLOBAL_HOOKS = [  # _global_forward_hooks, _global_backward_hooks, ... (the dicts of handles)
    name
    for name in dir(module_globals)
    if name.startswith("_global_") and isinstance(getattr(module_globals, name), dict)
]


def _user_hook(*args: Any) -> None:
    return None


def make_model() -> Messy:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Messy()
    model.inp.weight.grad = torch.ones_like(model.inp.weight)  # pending gradients of the user's own
    model.head_a.register_forward_hook(_user_hook)
    model.head_a.register_forward_pre_hook(_user_hook)
    model.head_a.register_full_backward_hook(_user_hook)
    return model


BATCH = torch.randn(16, 3, generator=torch.Generator().manual_seed(1))


def terms_of(model: nn.Module, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    a, b = model(batch)
    return {"a": a.pow(2).mean(), "b": b.pow(2).mean()}


@torch._dynamo.disable
def side_effects(model: nn.Module) -> None:
    """What a careless step does to the world (run eagerly even inside a compiled step)."""
    with torch.no_grad():
        model.head_a.bias.add_(1.0)
    model.head_b.weight.grad = torch.full_like(model.head_b.weight, 7.0)
    model.train()
    torch.rand(3)
    random.random()
    np.random.rand(2)


# ---------------------------------------------------------------------------- snapshots
def model_state(model: nn.Module) -> dict[str, Any]:
    named = list(model.named_parameters())
    return {
        "param_objects": {n: id(p) for n, p in named},
        "params": {n: p.detach().clone() for n, p in named},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in named},
        "grad_objects": {n: id(p.grad) for n, p in named},
        "requires_grad": {n: p.requires_grad for n, p in named},
        "modes": {n: m.training for n, m in model.named_modules()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "buffer_objects": {n: id(b) for n, b in model.named_buffers()},
        "hooks": {
            n: [
                list(getattr(m, h).items())
                for h in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
            ]
            for n, m in model.named_modules()
        },
    }


def flush_denormal() -> bool:
    """Whether subnormals are flushed to zero (torch has a setter only)."""
    return bool((torch.full((1,), 1e-310, dtype=torch.float64) * 1.0).item() == 0.0)


def global_state() -> dict[str, Any]:
    return {
        "grad_mode": torch.is_grad_enabled(),
        "default_dtype": torch.get_default_dtype(),
        "deterministic": (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        "anomaly": (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "configs": {m.__name__: m.get_config_copy() for m in CONFIG_MODULES},
        "function_modes": torch._C._len_torch_function_stack(),
        "dispatch_modes": torch._C._len_torch_dispatch_stack(),
        "autograd_grad": torch.autograd.grad,
        "global_hooks": {name: list(getattr(module_globals, name).items()) for name in GLOBAL_HOOKS},
        "eval_frame_callback": torch._C._dynamo.eval_frame.get_eval_frame_callback(),
        "default_device_context": getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None),
        "function_mode_objects": [id(m) for m in _get_current_function_mode_stack()],
        "num_threads": torch.get_num_threads(),
        "warn_always": torch.is_warn_always_enabled(),
        "flush_denormal": flush_denormal(),
        "autograd_multithreading": torch._C._is_multithreading_enabled(),
        "cudnn": (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic),
        "optimizer_hooks": [
            list(getattr(sys.modules["torch.optim.optimizer"], name).items())
            for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
        ],
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state(),
    }


def assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before.keys() == after.keys()
    for key, value in before.items():
        other = after[key]
        if key in ("params", "grads", "buffers"):
            for n, t in value.items():
                assert (t is None) == (other[n] is None), f"{key} {n}"
                assert t is None or torch.equal(t, other[n]), f"{key} {n} changed"
        elif key == "torch_rng":
            assert torch.equal(value, other), "torch RNG state changed"
        elif key == "numpy_rng":
            assert value[0] == other[0] and np.array_equal(value[1], other[1]) and value[2:] == other[2:]
        elif key == "configs":
            for name, config in value.items():
                changed = {k for k in config if config[k] != other[name].get(k)}
                assert not changed, f"{name} changed: {sorted(changed)}"
        else:
            assert value == other, f"{key}: {value!r} became {other!r}"


class World:
    """Everything a probe must leave as found: the model's state and the global state."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.before = {**model_state(model), **global_state()}

    def assert_unchanged(self) -> None:
        assert_same(self.before, {**model_state(self.model), **global_state()})


@pytest.fixture
def world() -> Iterator[World]:
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    yield World(make_model())


class Calls:
    """A step's call counter, outside dynamo's reach (read and bumped eagerly)."""

    def __init__(self) -> None:
        self.n = 0

    @torch._dynamo.disable
    def bump(self) -> int:
        self.n += 1
        return self.n


# ---------------------------------------------------------------------------- exceptions in the step
@pytest.mark.parametrize(
    ("variants", "fail_on", "failed"),
    [
        ("eager", 1, ("eager", "forward", "ValueError")),
        ("eager,compile:eager", 2, ("compile:eager", "forward", "ValueError")),
        ("eager,make_fx", 2, ("make_fx", "trace", "ValueError")),
    ],
)
def test_an_exception_in_the_step_is_recorded_and_nothing_changes(world, variants, fail_on, failed):
    calls = Calls()

    def step(model, batch):
        n = calls.bump()
        side_effects(model)
        if n >= fail_on:
            raise ValueError("the user's step failed")
        return terms_of(model, batch)

    fm = gradprobe.probe(world.model, step, BATCH, terms=["a", "b"], variants=variants)
    world.assert_unchanged()
    variant, stage, kind = failed
    errors = {(r.variant, r.error.stage, r.error.type) for r in fm.runs if r.error is not None}
    if stage == "trace":
        error = fm.variant(variant).error
        errors.add((variant, error.stage, error.type))
    assert (variant, stage, kind) in errors
    assert fm.run("eager", "all").error is None or fail_on == 1


def test_an_exception_in_a_weights_mode_scenario_is_recorded_and_nothing_changes(world):
    calls = Calls()

    def step(model, batch, weights):
        side_effects(model)
        if calls.bump() == 2:
            raise ValueError("second scenario fails")
        t = terms_of(model, batch)
        return weights["a"] * t["a"] + weights["b"] * t["b"]

    fm = gradprobe.probe(world.model, step, BATCH, terms=["a", "b"])
    world.assert_unchanged()
    assert fm.run("eager", "a only").error is None
    assert fm.run("eager", "b only").error.message == "second scenario fails"


def test_an_exception_before_the_terms_are_known_raises_and_nothing_changes(world):
    def step(model, batch):
        side_effects(model)
        raise ValueError("no terms yet")

    with pytest.raises(gradprobe.StepContractError, match="Declare terms="):
        gradprobe.probe(world.model, step, BATCH)
    world.assert_unchanged()


def test_a_variant_that_fails_to_compile_is_recorded_and_nothing_changes(world):
    def step(model, batch):
        t = terms_of(model, batch)
        torch._dynamo.graph_break()  # fullgraph=true refuses this
        return t

    fm = gradprobe.probe(
        world.model, step, BATCH, terms=["a", "b"], variants="eager,compile:eager[fullgraph=true]"
    )
    world.assert_unchanged()
    runs = [r for r in fm.runs if r.variant == "compile:eager[fullgraph=true]"]
    assert runs and all(r.error is not None and r.error.stage == "compile" for r in runs)
    assert fm.run("eager", "all").error is None
    assert _debug_get_cache_entry_list(step.__code__) == []
    user_compiled = torch.compile(step, backend="eager")  # the user's own compile still works
    assert user_compiled(world.model, BATCH).keys() == {"a", "b"}


# ---------------------------------------------------------------------------- KeyboardInterrupt
SECOND_BATCH = BATCH + 1


class Interrupt:
    """Raises KeyboardInterrupt from inside the step when ``when(model is a copy, batch, call number)``."""

    def __init__(self, when: Callable[[bool, Any, int], bool], user_model: nn.Module) -> None:
        self.when = when
        self.user_model = user_model
        self.calls = Calls()
        self.raised = False

    @torch._dynamo.disable
    def check(self, model: nn.Module, batch: Any) -> None:
        if self.when(model is not self.user_model, batch, self.calls.bump()):
            self.raised = True
            raise KeyboardInterrupt


class InterruptingBackward(torch.autograd.Function):
    """Identity whose backward raises KeyboardInterrupt (a Ctrl-C during autograd.grad)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise KeyboardInterrupt


KI_CASES: dict[str, tuple[dict[str, Any], Callable[[bool, Any, int], bool]]] = {
    "eager forward": ({}, lambda copy, b, n: n == 1),
    "weights-mode 2nd scenario": ({"mode": "weights"}, lambda copy, b, n: n == 2),
    "compiled run": ({"variants": "eager,compile:eager"}, lambda copy, b, n: n == 2),
    "compiled run, 3rd scenario": ({"variants": "eager,compile:eager"}, lambda copy, b, n: n == 4),
    "make_fx tracing": ({"variants": "eager,make_fx"}, lambda copy, b, n: n == 2),
    # the locator's TorchFunctionMode (and its global module hooks, its autograd.grad patch) is active
    "locator": ({"diagnose": True}, lambda copy, b, n: torch._C._len_torch_function_stack() > 0),
    # (quiet: no in-place parameter edits, which a make_fx graph replays outside no_grad and fails on)
    "second batch": (
        {"variants": "eager,make_fx", "second_batch": SECOND_BATCH, "quiet": True},
        lambda copy, b, n: b is SECOND_BATCH,
    ),
    "training check on a copy": ({"checks": ["training"]}, lambda copy, b, n: copy),
}


@pytest.mark.parametrize("case", list(KI_CASES))
def test_keyboard_interrupt_propagates_and_nothing_changes(world, case):
    options, when = KI_CASES[case]
    options = dict(options)
    interrupt = Interrupt(when, world.model)
    mode = options.pop("mode", "terms")
    quiet = options.pop("quiet", False)

    def step(model, batch):
        if not quiet:
            side_effects(model)
        interrupt.check(model, batch)
        return terms_of(model, batch)

    def weights_step(model, batch, weights):
        t = step(model, batch)
        return weights["a"] * t["a"] + weights["b"] * t["b"]

    with pytest.raises(KeyboardInterrupt):
        gradprobe.probe(
            world.model, step if mode == "terms" else weights_step, BATCH, terms=["a", "b"], **options
        )
    assert interrupt.raised
    world.assert_unchanged()
    assert _debug_get_cache_entry_list(step.__code__) == []


def test_keyboard_interrupt_raised_in_code_dynamo_traces_propagates(world):
    calls = [0]

    def step(model, batch):  # no dynamo.disable: dynamo traces the counter and the raise
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return terms_of(model, batch)

    with pytest.raises(KeyboardInterrupt):
        gradprobe.probe(world.model, step, BATCH, terms=["a", "b"], variants="eager,compile:eager")
    world.assert_unchanged()
    assert _debug_get_cache_entry_list(step.__code__) == []


@pytest.mark.parametrize("variants", ["eager", "eager,compile:eager"])
def test_keyboard_interrupt_in_a_backward_propagates_and_nothing_changes(world, variants):
    def step(model, batch):
        side_effects(model)
        t = terms_of(model, batch)
        return {"a": t["a"], "b": InterruptingBackward.apply(t["b"])}

    with pytest.raises(KeyboardInterrupt):
        gradprobe.probe(world.model, step, BATCH, terms=["a", "b"], variants=variants)
    world.assert_unchanged()


def test_keyboard_interrupt_while_a_backend_compiles_propagates(world, monkeypatch):
    def interrupting_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        raise KeyboardInterrupt

    from torch._dynamo.backends import registry

    interrupting_backend._tags = ()  # type: ignore[attr-defined]
    monkeypatch.setitem(registry._BACKENDS, "gradprobe_test_interrupt", None)
    monkeypatch.setitem(registry._COMPILER_FNS, "gradprobe_test_interrupt", interrupting_backend)

    def step(model, batch):
        return terms_of(model, batch)

    with pytest.raises(KeyboardInterrupt):
        gradprobe.probe(
            world.model, step, BATCH, terms=["a", "b"], variants="eager,compile:gradprobe_test_interrupt"
        )
    world.assert_unchanged()
    assert _debug_get_cache_entry_list(step.__code__) == []


# ---------------------------------------------------------------------------- global settings
def careless_step(model, batch):
    """A step that changes global settings and leaves them changed."""
    side_effects(model)
    model.head_a.weight.requires_grad_(False)
    torch._dynamo.config.recompile_limit = 1
    torch._inductor.config.fallback_random = not torch._inductor.config.fallback_random
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_float32_matmul_precision("medium")
    torch.autograd.set_detect_anomaly(False, check_nan=False)
    torch.set_default_device("cpu")  # pushes a DeviceContext onto the function-mode stack
    torch.set_num_threads(1)
    torch.set_warn_always(True)
    torch.set_flush_denormal(True)
    torch.autograd.set_multithreading_enabled(False)  # a call, not only a context manager
    torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark
    register_optimizer_step_pre_hook(lambda opt, args, kwargs: None)
    out = terms_of(model, batch)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    return out


@pytest.mark.parametrize("fail", [False, True])
def test_global_settings_a_step_changes_are_restored(world, fail):
    def step(model, batch):
        out = careless_step(model, batch)
        if fail:
            raise KeyboardInterrupt
        return out

    if fail:
        with pytest.raises(KeyboardInterrupt):
            gradprobe.probe(world.model, step, BATCH, terms=["a", "b"])
    else:
        gradprobe.probe(world.model, step, BATCH, terms=["a", "b"], mode="terms")
    world.assert_unchanged()


def test_settings_are_restored_even_when_the_world_was_unusual(world):
    # Non-default settings before the probe stay as the user set them.
    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True)
    torch._dynamo.config.recompile_limit = 3
    try:
        w = World(make_model().double())
        fm = gradprobe.probe(w.model, careless_step, BATCH.double(), terms=["a", "b"])
        w.assert_unchanged()
        assert fm.dtype == "float64"
        assert torch.get_default_dtype() == torch.float64 and torch.are_deterministic_algorithms_enabled()
        assert torch._dynamo.config.recompile_limit == 3
    finally:
        torch.set_default_dtype(torch.float32)
        torch.use_deterministic_algorithms(False)
        torch._dynamo.config.recompile_limit = world.before["configs"]["torch._dynamo.config"][
            "recompile_limit"
        ]


class NoCopy:
    """A custom compiler pass that refuses to be deep-copied (it may hold a lock, a process pool)."""

    def __deepcopy__(self, memo: Any) -> Any:
        raise TypeError("cannot copy me")

    def __call__(self, graph: Any) -> None:
        return None


def test_a_config_value_that_cannot_be_copied_does_not_break_the_probe():
    mine, theirs = NoCopy(), NoCopy()

    def step(model, batch):
        torch._inductor.config.post_grad_custom_post_pass = theirs  # changed by the step
        torch._dynamo.config.recompile_limit = 2
        return terms_of(model, batch)

    before = torch._dynamo.config.recompile_limit
    torch._inductor.config.post_grad_custom_pre_pass = mine  # set by the user before the probe
    try:
        fm = gradprobe.probe(make_model(), step, BATCH, terms=["a", "b"])
        assert fm.run("eager", "all").error is None
        assert torch._inductor.config.post_grad_custom_pre_pass is mine
        assert torch._dynamo.config.recompile_limit == before  # the dynamo config was still restored
    finally:
        torch._inductor.config.post_grad_custom_pre_pass = None
        torch._inductor.config.post_grad_custom_post_pass = None
        torch._dynamo.config.recompile_limit = before


# ---------------------------------------------------------------------------- threads
def test_probes_in_two_threads_give_the_results_of_one_at_a_time():
    # Each probe reseeds the process-wide RNG before its runs; a step that draws after a pause lets the
    # other thread reseed in between, unless probes run one at a time.
    def step(m, b):
        time.sleep(0.02)
        a, c = m(b * torch.rand(b.shape))
        return {"a": a.pow(2).mean(), "b": c.pow(2).mean()}

    models = [make_model(), make_model()]
    alone = [gradprobe.probe(m, step, BATCH, seed=s) for m, s in zip(models, (1, 2), strict=True)]
    for _ in range(3):
        maps: list[Any] = [None, None]

        def run(i: int, maps: list[Any] = maps) -> None:
            maps[i] = gradprobe.probe(models[i], step, BATCH, seed=i + 1)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for got, want in zip(maps, alone, strict=True):
            assert got is not None and all(r.error is None and r.term_values for r in got.runs)
            assert [r.term_values for r in got.runs] == [r.term_values for r in want.runs]


# ---------------------------------------------------------------------------- the user's dynamo caches
def test_compiled_variants_leave_the_users_dynamo_caches_empty(world):
    def step(model, batch):
        return terms_of(model, batch)

    def breaking_step(model, batch):  # a graph break inside the step: dynamo compiles its frame
        a, b = model(batch)
        torch._dynamo.graph_break()
        return {"a": a.pow(2).mean(), "b": b.pow(2).mean()}

    for user_step, variants in (
        (step, "eager,compile:eager,make_fx+compile:eager"),
        (breaking_step, "eager,compile:eager"),
    ):
        fm = gradprobe.probe(world.model, user_step, BATCH, terms=["a", "b"], variants=variants)
        assert all(r.error is None for r in fm.runs), [r.error for r in fm.runs]
        assert _debug_get_cache_entry_list(user_step.__code__) == []
        world.assert_unchanged()
        # The user compiles the same step afterwards: it compiles (one entry) and runs like eager.
        compiled = torch.compile(user_step, backend="eager")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            got = compiled(world.model, BATCH)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            want = user_step(world.model, BATCH)
        assert len(_debug_get_cache_entry_list(user_step.__code__)) == 1
        for k in want:
            torch.testing.assert_close(got[k], want[k])
        torch._dynamo.reset()  # the test's own compile: not part of the next round
        world = World(world.model)


# ---------------------------------------------------------------------------- optimizer and copies
def test_training_check_never_steps_the_users_optimizer(world):
    model = world.model
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    loss = sum(terms_of(model, BATCH).values())
    loss.backward()
    optimizer.step()  # the user's optimizer has momentum buffers
    world = World(model)
    saved = optimizer.state_dict()
    buffers = {k: {n: v.clone() for n, v in s.items()} for k, s in saved["state"].items()}

    def step(m, batch):
        return terms_of(m, batch)

    fm = gradprobe.probe(model, step, BATCH, terms=["a", "b"], optimizer=optimizer, checks=["training"])
    world.assert_unchanged()
    assert fm.checks["training"]["optimizer"] == "SGD"
    after = optimizer.state_dict()
    assert after["param_groups"] == saved["param_groups"]
    for k, s in buffers.items():
        for n, v in s.items():
            assert torch.equal(after["state"][k][n], v), (k, n)


def test_an_optimizer_factory_never_gets_the_users_parameters(world):
    # A factory that registers hooks on what it is given (an optimizer-in-backward pattern): they land
    # on gradprobe's stand-ins, never on the user's parameters.
    given: list[torch.Tensor] = []

    def factory(params):
        given.extend(params)
        for p in params:
            p.register_post_accumulate_grad_hook(lambda p: None)
        return torch.optim.SGD(params, lr=0.1)

    fm = gradprobe.probe(world.model, terms_of, BATCH, optimizer=factory, checks=["balance", "training"])
    assert fm.checks["balance"]["optimizer"]["optimizer"] == "SGD"
    assert fm.checks["training"]["optimizer"] == "SGD"
    mine = {id(p) for p in world.model.parameters()}
    assert given and not any(id(p) in mine for p in given)
    assert all(not p._post_accumulate_grad_hooks for p in world.model.parameters())
    world.assert_unchanged()


# ---------------------------------------------------------------------------- how often the step runs
@pytest.mark.parametrize(
    ("options", "calls"),
    [
        ({}, 1),  # eager, terms mode: one forward, one gradient per term
        ({"mode": "weights"}, 3),  # one run per scenario: a only, b only, all
        ({"variants": "eager,make_fx"}, 2),  # + one trace (the traced graph runs without Python)
        ({"variants": "eager,compile:eager"}, 4),  # + one run per scenario of the compiled step
        ({"variants": "eager,make_fx", "second_batch": SECOND_BATCH}, 3),  # + eager on the second batch
    ],
    ids=["eager", "weights", "make_fx", "compile", "second-batch"],
)
def test_how_often_the_users_step_runs(world, options, calls):
    options = dict(options)
    counter = Calls()

    def step(model, batch):
        counter.bump()
        return terms_of(model, batch)

    def weights_step(model, batch, weights):
        t = step(model, batch)
        return weights["a"] * t["a"] + weights["b"] * t["b"]

    the_step = weights_step if options.pop("mode", "terms") == "weights" else step
    gradprobe.probe(world.model, the_step, BATCH, terms=["a", "b"], **options)
    assert counter.n == calls
    world.assert_unchanged()
