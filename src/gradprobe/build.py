"""Building a variant: the callable ``run(batch, weights)`` that executes the user's step one way.

Every variant computes ``(total, {term: value})`` through the model's own parameters, so gradients
are taken with respect to the very tensors the user trains. Variants are built once and reused for
every scenario; weights are 0-dim tensor inputs, so a compiled variant compiles once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.func import functional_call

from .flowmap import RunError
from .rng import reseed
from .variants import VariantSpec

Run = Callable[[Any, Mapping[str, torch.Tensor]], Any]


@dataclass
class VariantContext:
    """What a variant builder gets: the model, the user's step and its contract, an example batch."""

    model: torch.nn.Module
    step: Callable[..., Any]
    mode: str  # "terms" | "weights"
    terms: Sequence[str]
    batch: Any
    weights: Mapping[str, torch.Tensor]
    knobs: Mapping[str, Any] = field(default_factory=dict)  # a user variant's knob values
    seed: int = 0  # every RNG is seeded with it before the build (a trace runs the step once)

    def weighted(self) -> Callable[[torch.nn.Module, Any, Mapping[str, torch.Tensor]], Any]:
        """A fresh function ``(model, batch, weights) -> (total, {term: value})`` around the user's step.

        Fresh per call (a new code object, and a copy of the step's function): dynamo caches compiled
        code per code object, so gradprobe's compiles never land in the cache of the user's own step.
        """
        return _weighted(fresh_copy(self.step), self.mode, tuple(self.terms))


def _weighted(step: Callable[..., Any], mode: str, terms: tuple[str, ...]) -> Callable[..., Any]:
    if mode == "terms":

        def weighted(model, batch, weights):  # type: ignore[no-untyped-def]
            values = step(model, batch)
            total = weights[terms[0]] * values[terms[0]]
            for t in terms[1:]:
                total = total + weights[t] * values[t]
            return total, values

    else:

        def weighted(model, batch, weights):  # type: ignore[no-untyped-def]
            return step(model, batch, weights)

    return fresh_copy(weighted)


def pack_weights(weights: Mapping[str, torch.Tensor], terms: Sequence[str]) -> torch.Tensor:
    """The weights as one 1-D tensor in ``terms`` order: what traced and compiled variants take.

    0-dim CPU tensor inputs are turned into symbolic floats by dynamo (torch 2.13) and then
    specialised again by a ``TensorifyScalarRestartAnalysis``: every compile ran twice. A 1-D input
    is a plain tensor input; it is unbound into 0-dim tensors inside the graph.
    """
    return torch.stack([weights[t] for t in terms])


def unpack_weights(packed: torch.Tensor, terms: Sequence[str]) -> dict[str, torch.Tensor]:
    return dict(zip(terms, packed.unbind(0), strict=True))


def _vector_weighted(weighted: Callable[..., Any], terms: tuple[str, ...]) -> Callable[..., Any]:
    def vector_weighted(model, batch, packed):  # type: ignore[no-untyped-def]
        return weighted(model, batch, unpack_weights(packed, terms))

    return fresh_copy(vector_weighted)


def fresh_copy(fn: Any) -> Any:
    """A copy of a plain function (or a partial of one) with its own code object; others as they are."""
    if isinstance(fn, functools.partial):
        return functools.partial(fresh_copy(fn.func), *fn.args, **fn.keywords)
    if isinstance(fn, types.FunctionType):
        copy = types.FunctionType(
            fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
        )
        copy.__kwdefaults__ = fn.__kwdefaults__
        copy.__qualname__ = fn.__qualname__
        copy.__dict__.update(fn.__dict__)
        return copy
    return fn


class CompileCounter:
    """Wraps a dynamo backend to count the graphs it compiles and how often compiled graphs run.

    A run that executes no compiled graph ran in eager: past dynamo's recompile limit (or for a frame
    dynamo decided to skip) a "compiled" variant silently measures eager. ``executions`` tells.
    """

    def __init__(self, backend: str) -> None:
        from torch._dynamo import lookup_backend

        self.backend_name = backend
        self._backend = lookup_backend(backend)
        self.graphs = 0
        self.executions = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.graphs += 1
        compiled = self._backend(gm, example_inputs)
        counter = self

        def run(*args: Any, **kwargs: Any) -> Any:
            counter.executions += 1
            return compiled(*args, **kwargs)

        # Keep the calling convention the backend declared (boxed: one list argument).
        if hasattr(compiled, "_boxed_call"):
            run._boxed_call = compiled._boxed_call  # type: ignore[attr-defined]
        return run


@dataclass
class Built:
    """A built variant: its run function, or the error that stopped the build.

    A user variant's builder may return one itself. ``counter`` needs ``graphs`` and ``executions``
    (a run in which ``executions`` did not grow ran no compiled code and is recorded as such);
    ``graph`` may be set during the first run (a trainer that traces lazily); ``predict`` gives the
    path's own energy, forces and virial for the physics check of that path. Its parameters are the
    first ``graph_params`` placeholders (default: one per probed parameter, gradprobe's own traces)
    plus any ``get_attr`` node holding a tensor that requires grad (a trace that baked the module's
    parameters in). ``advice`` maps a cause name to the fix in this variant's own terms.
    """

    run: Run | None = None
    error: RunError | None = None
    counter: Any = None
    graph: torch.fx.GraphModule | None = None  # the traced graph, for the graph lint
    notes: list[str] = field(default_factory=list)
    graph_params: int | None = None
    advice: dict[str, str] = field(default_factory=dict)
    # The path's own model outputs on a batch, ``{"energy": (frames,), "force": (frames, atoms, 3),
    # "virial": (frames, 3, 3)}``, for the physics check of this path (a trainer's compiled path).
    predict: Callable[[Any], Mapping[str, torch.Tensor]] | None = None
    module: torch.nn.Module | None = None  # compile_model: the compiled module the step is given


@contextlib.contextmanager
def module_mode(model: torch.nn.Module, mode: str) -> Iterator[None]:
    """Put every submodule in train or eval mode for the body ("as-is" leaves them); restore after."""
    if mode == "as-is":
        yield
        return
    saved = [(m, m.training) for m in model.modules()]
    model.train(mode == "train")
    try:
        yield
    finally:
        for m, training in saved:
            m.training = training


def _autocast(device: torch.device, knob: str) -> contextlib.AbstractContextManager[Any]:
    if knob == "off":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if knob == "bf16" else torch.float16)


@contextlib.contextmanager
def _compile_context(variant: VariantSpec) -> Iterator[None]:
    """What a compiled variant's runs (where compilation happens, lazily) need: inductor draws the same
    random numbers as eager (dropout), so values can be compared; ``donated_buffer=false`` turns
    AOTAutograd's donated buffers off (restored after)."""
    with contextlib.ExitStack() as stack:
        if variant.backend == "inductor":
            import torch._inductor.config as inductor_config

            stack.enter_context(inductor_config.patch(fallback_random=True))
        if variant.compiled and variant.knob("donated_buffer") is False:
            import torch._functorch.config as functorch_config

            stack.enter_context(functorch_config.patch(donated_buffer=False))
        yield


def _no_detach(x: torch.Tensor) -> torch.Tensor:
    # An alias keeps the autograd history that make_fx's recorded detach nodes would cut (PyTorch #175477).
    return torch.ops.aten.alias.default(x)


NO_DETACH_DECOMPOSITION = {torch.ops.aten.detach.default: _no_detach}


def trace_step(ctx: VariantContext, variant: VariantSpec) -> torch.fx.GraphModule:
    """make_fx over ``(params, buffers, batch, weights) -> (total, values)``, with the variant's knobs."""
    from torch.fx.experimental.proxy_tensor import make_fx

    weighted = ctx.weighted()
    holder = _StepHolder(ctx.model, weighted)

    terms = tuple(ctx.terms)

    def functional(params: dict, buffers: dict, batch: Any, packed: torch.Tensor) -> Any:
        weights = unpack_weights(packed, terms)
        return functional_call(holder, {**params, **buffers}, (batch, weights), strict=False)

    params, buffers = _state(holder)
    decompositions = NO_DETACH_DECOMPOSITION if variant.knob("detach") == "alias" else None
    with (
        module_mode(ctx.model, variant.knob("mode")),
        _autocast(_device(ctx.model), variant.knob("autocast")),
    ):
        return make_fx(
            functional,
            decomposition_table=decompositions,
            tracing_mode=variant.knob("tracing_mode"),
            pre_dispatch=variant.knob("pre_dispatch"),
            record_stack_traces=True,
            record_module_stack=True,
        )(params, buffers, ctx.batch, pack_weights(ctx.weights, terms))


class _StepHolder(torch.nn.Module):
    """Makes the step a module call, so ``functional_call`` can swap in parameters for tracing."""

    def __init__(self, model: torch.nn.Module, weighted: Callable[..., Any]) -> None:
        super().__init__()
        self.model = model
        self._weighted = weighted

    def forward(self, batch: Any, weights: dict) -> Any:
        return self._weighted(self.model, batch, weights)


def _state(holder: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return dict(holder.named_parameters()), dict(holder.named_buffers())


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


TRACE_KNOBS = ("mode", "autocast", "tracing_mode", "pre_dispatch", "detach")


def trace_key(ctx: VariantContext, variant: VariantSpec) -> tuple[Any, ...]:
    """Everything a make_fx trace of the step depends on, as a hashable key.

    The capture knobs (not the backend or the compile knobs: the same trace is compiled either way);
    the modules' train/eval flags ("as-is" traces whatever they are); the step, its contract and
    terms; each parameter's and buffer's identity, version counter, shape, dtype and device (an
    in-place change by the user, an optimizer step, bumps the version); the batch's leaves (a tensor
    by identity, version, shape, dtype, device; a Python value by value: make_fx specialises on it);
    the weights' values (``pre_dispatch`` freezes trace-time tensors into the graph); grad mode and
    the default dtype.
    """
    from torch.utils._pytree import tree_flatten

    def tensor(t: torch.Tensor) -> tuple[Any, ...]:
        return (id(t), t._version, tuple(t.shape), t.dtype, t.device, t.requires_grad)

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return tensor(x)
        if x is None or isinstance(x, (bool, int, float, str)):
            return (type(x).__name__, x)
        return (type(x).__qualname__, id(x))

    leaves, tree = tree_flatten(ctx.batch)
    return (
        tuple(variant.knob(k) for k in TRACE_KNOBS),
        id(ctx.model),
        tuple(m.training for m in ctx.model.modules()),
        id(ctx.step),
        ctx.mode,
        tuple(ctx.terms),
        tuple((n, tensor(t)) for n, t in ctx.model.named_parameters()),
        tuple((n, tensor(t)) for n, t in ctx.model.named_buffers()),
        str(tree),
        tuple(leaf(x) for x in leaves),
        tuple((t, float(ctx.weights[t])) for t in ctx.terms),
        torch.is_grad_enabled(),
        torch.get_default_dtype(),
    )


class TraceCache:
    """make_fx traces shared between builds that differ only in what is done with the trace (the
    backend, ``fullgraph``, ``dynamic``, ``donated_buffer``): a bisection's backend ladder and its
    fix verification re-use one trace instead of tracing per trial.

    Keyed by ``trace_key``. Meant to live for one bisection (one probe's diagnosis): nothing of the
    user's may change in between, and the key's version counters and identities make a change show
    anyway. A failed trace is not kept. Every build gets its own GraphModule over the graph:
    dynamo caches compiled code per code object, and one shared module compiled for several
    backends would pile up recompiles toward dynamo's limit, past which it silently runs eager.
    """

    def __init__(self) -> None:
        self._graphs: dict[tuple[Any, ...], torch.fx.GraphModule] = {}
        self.traced = 0
        self.reused = 0

    def trace(self, ctx: VariantContext, variant: VariantSpec) -> torch.fx.GraphModule:
        """The trace for ``variant``: a fresh module over the kept graph, traced on first use."""
        key = trace_key(ctx, variant)
        gm = self._graphs.get(key)
        if gm is None:
            gm = trace_step(ctx, variant)  # raises on failure: nothing kept
            self.traced += 1
            self._graphs[key] = gm
        else:
            self.reused += 1
        return _module_copy(gm)


def _module_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A new GraphModule over ``gm``'s graph: its own generated code, and so its own dynamo cache.
    The graph and attributes (a pre_dispatch trace's frozen constants) are shared: nothing of
    gradprobe's changes them (a backend's passes work on dynamo's graph, not on this one)."""
    return torch.fx.GraphModule(gm, gm.graph)


def build(variant: VariantSpec, ctx: VariantContext, traces: TraceCache | None = None) -> Built:
    """Build ``variant`` once. A failure to trace is returned as the build's error, not raised.

    ``traces`` (a bisection's): make_fx traces are taken from it, and re-used where only the compile
    changes (its counters say which builds traced)."""
    from .measure import run_error

    # A trace runs the step: it must draw the random numbers every other run of the probe draws.
    reseed(ctx.seed)
    device = _device(ctx.model)
    autocast = variant.knob("autocast") if variant.capture != "user" else "off"
    mode = variant.knob("mode") if variant.capture != "user" else "as-is"

    if variant.capture == "user":
        assert variant.builder is not None
        try:
            made = variant.builder(dataclasses.replace(ctx, knobs={**variant.knobs}))
        except Exception as e:
            return Built(error=run_error("build", e))
        return made if isinstance(made, Built) else Built(run=made)

    if variant.capture == "make_fx":
        try:
            gm = trace_step(ctx, variant) if traces is None else traces.trace(ctx, variant)
        except Exception as e:
            return Built(error=run_error("trace", e))
        holder_params, holder_buffers = _state(_StepHolder(ctx.model, ctx.weighted()))
        target: Callable[..., Any] = gm
        built = Built(graph=gm)
        if variant.compiled:
            built.counter = CompileCounter(variant.backend)  # type: ignore[arg-type]
            target = torch.compile(gm, backend=built.counter, fullgraph=variant.knob("fullgraph"),
                                   dynamic=variant.knob("dynamic"))  # fmt: skip
        context = functools.partial(_compile_context, variant)

        def run_traced(batch: Any, weights: Mapping[str, torch.Tensor]) -> Any:
            with context():
                return target(holder_params, holder_buffers, batch, pack_weights(weights, ctx.terms))

        built.run = run_traced
        return built

    weighted = ctx.weighted()
    built = Built()
    target = weighted
    context = functools.partial(_compile_context, variant)
    if variant.capture == "model":
        # Only the module is compiled (sharing its parameters); the step, its loss and any
        # autograd.grad run eagerly around it, so switched-off terms are never differentiated.
        built.counter = CompileCounter(variant.backend)  # type: ignore[arg-type]
        compiled_model = torch.compile(ctx.model, backend=built.counter, fullgraph=variant.knob("fullgraph"),
                                       dynamic=variant.knob("dynamic"))  # fmt: skip

        def run_model_compiled(batch: Any, weights: Mapping[str, torch.Tensor]) -> Any:
            with module_mode(ctx.model, mode), _autocast(device, autocast), context():
                return weighted(compiled_model, batch, weights)

        built.run = run_model_compiled
        built.module = compiled_model
        return built
    if variant.compiled:
        built.counter = CompileCounter(variant.backend)  # type: ignore[arg-type]
        target = torch.compile(_vector_weighted(weighted, tuple(ctx.terms)), backend=built.counter,
                               fullgraph=variant.knob("fullgraph"), dynamic=variant.knob("dynamic"))  # fmt: skip

    def run_direct(batch: Any, weights: Mapping[str, torch.Tensor]) -> Any:
        with module_mode(ctx.model, mode), _autocast(device, autocast), context():
            return target(ctx.model, batch, pack_weights(weights, ctx.terms) if variant.compiled else weights)

    built.run = run_direct
    return built
