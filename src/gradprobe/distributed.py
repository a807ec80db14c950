"""Gradient flow under ``torch.distributed``: a flow map per rank, merged the way DDP reduces gradients.

Inside a job launched with ``torchrun`` (or any initialised process group), every rank probes its own
batch (``spec.batch`` is rank-local) before any gradient reduction: gradients are taken with
``torch.autograd.grad``, which fires none of DDP's reducer hooks, and a ``DistributedDataParallel``
model runs its step under ``no_sync()``. The local flow maps are gathered to every rank
(``all_gather_object`` of their plain ``to_dict()`` form) and merged:

* per (variant, scenario, parameter): the ranks that reach it (status ``nonzero``);
* the merged cells of the eager variant hold the statuses and L1 norms of the *reduced* gradient,
  averaged over ranks as DDP does (``all_reduce`` of each scenario's gradients, divided by the world
  size; a gradient that is ``None`` on one rank and present on another counts as zeros there). Under
  FSDP2 (``fully_shard``) they come from FSDP's own reduce-scatter: the per-shard L1 norms are summed
  and the per-shard max-abs values maxed over ranks, so a shard that is empty or zero on one rank does
  not make a parameter unreached;
* parameter values are compared across ranks with a float64 checksum per parameter.

Every rank returns the same merged map, diagnosed like any other. ``checks["distributed"]`` holds the
per-rank detail, from which the causes ``ddp-locally-unused``, ``ddp-globally-unused`` and
``rank-divergence`` (``causes/``) say what DDP (or FSDP) setting the result calls for; ``report.ranks``
renders it. See docs/distributed.md.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from .batch import with_differentiable_inputs
from .diagnose import diagnose as diagnose_map
from .errors import GradProbeError, SpecError
from .flowmap import Cell, FlowMap, Run, RunError, VariantInfo
from .measure import Measurement, per_scenario, per_term
from .probe import probe
from .rng import reseed, restore_rng, save_rng
from .scenarios import Scenario, resolve_scenarios
from .spec import ProbeSpec, resolve_model
from .state import preserved
from .status import INF, NAN, NONE, NONZERO, ZERO, reduce_grads, status_of
from .step import check_terms, check_total, make_weights
from .variants import VariantSpec, parse_variants

__all__ = ["init_from_env", "merge_maps", "probe_distributed"]

# Statuses combined over ranks, strongest first: a NaN anywhere is a NaN in the reduced gradient.
_PRECEDENCE = (NAN, INF, NONZERO, ZERO, NONE)


# ----- process group ------------------------------------------------------------------------------


def init_from_env(backend: str | None = None) -> bool:
    """Initialise the default process group from torchrun's environment, if not done yet.

    Returns True when this call initialised it. ``backend`` defaults to ``gloo`` on a machine without
    CUDA and to ``cpu:gloo,cuda:nccl`` with CUDA (NCCL for CUDA tensors, gloo for CPU ones); with CUDA,
    the rank's device is set to ``cuda:LOCAL_RANK``.
    """
    if not dist.is_available():
        raise GradProbeError("torch.distributed is not available in this torch build")
    if dist.is_initialized():
        return False
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise SpecError(
            f"no torch.distributed process group is initialised and {', '.join(missing)} "
            "is not set: launch with torchrun (torchrun --nproc_per_node N script.py), call "
            "torch.distributed.init_process_group() first, or use `gradprobe run FILE.py --nproc N`"
        )
    cuda = torch.cuda.is_available()
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    return True


# ----- wrappers: DDP, FSDP2 -----------------------------------------------------------------------


def _dtensor_type() -> type | None:
    """``DTensor``, if its module is loaded: a model cannot hold one otherwise (importing it costs
    seconds, so it is not imported here)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def _is_dtensor(t: Any) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def _is_fsdp2(model: torch.nn.Module) -> bool:
    module = sys.modules.get("torch.distributed.fsdp")
    fsdp_module = getattr(module, "FSDPModule", None)  # FSDP2; absent in old torch, unloaded if unused
    return fsdp_module is not None and any(isinstance(m, fsdp_module) for m in model.modules())


def _unwrap(model: torch.nn.Module) -> tuple[str, torch.nn.Module, torch.nn.Module | None]:
    """(kind, module whose parameters are probed, DDP wrapper or None); kind: ddp, fsdp2 or none."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return "ddp", model.module, model
    fsdp1 = getattr(sys.modules.get("torch.distributed.fsdp"), "FullyShardedDataParallel", None)
    if fsdp1 is not None and isinstance(model, fsdp1):
        raise SpecError(
            "the model is wrapped in FullyShardedDataParallel (FSDP1), whose flat parameters hide the "
            "model's own: probe the model sharded with torch.distributed.fsdp.fully_shard (FSDP2), wrapped "
            "in DistributedDataParallel, or unwrapped"
        )
    if _is_fsdp2(model):
        return "fsdp2", model, None
    return "none", model, None


def _redirected(step: Callable[..., Any], inner: torch.nn.Module, ddp: torch.nn.Module | None) -> Callable:
    """The user's step, called with the DDP wrapper (under ``no_sync``) when gradprobe passes ``inner``."""
    if ddp is None:
        return step

    def call(model: torch.nn.Module, batch: Any, *weights: Any) -> Any:
        if model is not inner:  # a copy (training check): no DDP around it
            return step(model, batch, *weights)
        with ddp.no_sync():  # type: ignore[operator]
            return step(ddp, batch, *weights)

    return call


def _fsdp_groups(model: torch.nn.Module) -> list[tuple[Any, Any, list[Any]]]:
    from torch.distributed.fsdp import FSDPModule

    out = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:
                single = getattr(state, "_fsdp_param_group", None)
                groups = [single] if single is not None else []
            out.append((m, state, list(groups)))
    return out


_GROUP_SETTINGS = (
    "post_forward_mesh_info",
    "reshard_after_backward",
    "reduce_grads",
    "reduce_scatter_unused_params",
)


@contextlib.contextmanager
def _fsdp_settings(model: torch.nn.Module) -> Iterator[list[tuple[Any, Any, list[Any]]]]:
    """Restore FSDP2's per-group settings (resharding, gradient sync, unused params) on exit."""
    groups = _fsdp_groups(model)
    saved = [
        (state, getattr(state, "_auto_reshard_after_forward", None), [
            (g, {a: getattr(g, a) for a in _GROUP_SETTINGS if hasattr(g, a)}) for g in gs
        ])
        for _, state, gs in groups
    ]  # fmt: skip
    try:
        yield groups
    finally:
        for state, auto, gs in saved:
            if auto is not None:
                state._auto_reshard_after_forward = auto
            for g, values in gs:
                for a, v in values.items():
                    setattr(g, a, v)


@contextlib.contextmanager
def _fsdp_unsharded(model: torch.nn.Module) -> Iterator[None]:
    """FSDP2 modules all-gathered for the local probe: the registered parameters are then the plain,
    unsharded ones that the forward uses, so ``autograd.grad`` gives each rank's local gradient. No
    resharding and no gradient reduction happen until the block ends; the sharded parameters (and
    their ``.grad``) are registered again afterwards."""
    sharded_grads = [(p, p.grad) for p in model.parameters()]
    with _fsdp_settings(model) as groups:
        for m, _, _ in groups:
            m.set_reshard_after_forward(False, recurse=False)
            m.set_reshard_after_backward(False, recurse=False)
            m.set_requires_gradient_sync(False, recurse=False)
        try:
            for m, _, _ in groups:
                m.unshard()
            yield
        finally:
            for m, _, _ in groups:
                m.reshard()
            for p, g in sharded_grads:
                p.grad = g


# ----- the probe ----------------------------------------------------------------------------------


def _is_plain_eager(v: VariantSpec) -> bool:
    return v.capture == "eager" and v.backend is None and not v.knobs


def gather_or_raise(payload: Any, error: BaseException | None, group: Any) -> list[Any]:
    """all_gather_object of each rank's payload; if any rank failed, every rank raises its message."""
    world = dist.get_world_size(group)
    item: dict[str, Any]
    if error is None:
        item = {"value": payload}
    elif isinstance(error, GradProbeError):
        item = {"error": str(error)}
    else:
        item = {"error": f"{type(error).__name__}: {error}"}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, item, group=group)
    failed = [(r, g["error"]) for r, g in enumerate(gathered) if "error" in g]
    if failed:
        messages = {msg for _, msg in failed}
        if len(failed) == world and len(messages) == 1:
            text = f"{messages.pop()} (on every rank)" if world > 1 else messages.pop()
        else:
            text = f"failed on {len(failed)} of {world} ranks: " + "; ".join(
                f"rank {r}: {msg}" for r, msg in failed
            )
        raise GradProbeError(text) from error
    return [g["value"] for g in gathered]


def _comm_device(params: Sequence[torch.Tensor]) -> torch.device:
    p = params[0]
    local = p.to_local() if _is_dtensor(p) else p
    return local.device if local.device.type != "meta" else torch.device("cpu")


def probe_distributed(
    spec: ProbeSpec,
    variants: str | Sequence[str | VariantSpec] | None = "eager",
    *,
    reference: str | None = None,
    diagnose: bool = False,
    checks: Sequence[str] = (),
    group: Any = None,
    divergence_rtol: float = 1e-9,
    progress: bool = True,
) -> FlowMap:
    """Probe every rank's batch and merge: which ranks reach each parameter, and the reduced gradient.

    Call it on every rank of an initialised process group (it initialises one from torchrun's
    environment variables if there is none). ``spec.batch`` is the rank's own batch; ``spec.model``
    may be a ``DistributedDataParallel`` wrapper (the step is called with the wrapper, under
    ``no_sync()``; parameter names are those of ``ddp.module``), an FSDP2 (``fully_shard``) model, or
    a plain module replicated on every rank. ``variants``, ``reference``, ``diagnose`` and ``checks``
    are those of ``gradprobe.probe`` and apply to each rank's local probe; the merged map keeps rank
    0's variant facts, checks, bisections and breaks. ``divergence_rtol``: relative difference of a
    parameter's checksum between ranks above which replicated values count as out of sync.
    ``progress``: rank 0 shows its local probe's progress on stderr (the other ranks stay quiet).

    Returns the merged flow map, the same on every rank; ``checks["distributed"]`` holds the per-rank
    detail (see docs/distributed.md).
    """
    if not isinstance(spec, ProbeSpec):
        raise SpecError(f"probe_distributed takes a gradprobe.ProbeSpec, got {type(spec).__name__}")
    init_from_env()
    world = dist.get_world_size(group)
    backend = str(dist.get_backend(group))

    def prepare() -> tuple[Any, ...]:
        model = resolve_model(spec)
        kind, inner, ddp = _unwrap(model)
        mode = spec.resolved_mode()
        local_spec = replace(spec, model=inner, step=_redirected(spec.step, inner, ddp), mode=mode)
        return model, kind, inner, ddp, mode, local_spec, parse_variants(variants or spec.variants or "eager")

    prepared, error = attempt(prepare)
    gather_or_raise(None, error, group)  # every rank stops if one cannot build its model or spec
    model, kind, inner, ddp, mode, local_spec, parsed = prepared
    want_reduced = any(_is_plain_eager(v) for v in parsed)

    # 1. the local flow map of every rank, gathered to every rank (FSDP2: all-gathered parameters)
    reduced: dict[str, tuple[list[str], list[float | None]] | None] = {}
    source = None
    with _fsdp_unsharded(inner) if kind == "fsdp2" else contextlib.nullcontext():
        local, error = attempt(
            lambda: probe(
                local_spec,
                variants=parsed,
                reference=reference,
                diagnose=diagnose,
                checks=checks,
                progress=progress and dist.get_rank(group) == 0,
            )
        )
        gathered = gather_or_raise(None if local is None else local.to_dict(), error, group)
        maps = [FlowMap.from_dict(d) for d in gathered]
        assert local is not None
        _same_parameters(maps)
        failed = _failed_anywhere(maps)
        # FSDP2 reduces through its own reduce-scatter unless ranks differ in which parameters
        # have a gradient path: then FSDP's collectives would not match (it would deadlock or abort).
        sharded = kind == "fsdp2" and not _rank_dependent_paths(maps)
        if want_reduced and not sharded:
            # 2a. the reduced gradient of each scenario: local eager gradients, all-reduced
            params = [p for _, p in inner.named_parameters() if p.requires_grad]
            kept, error = attempt(lambda: _local_gradients(local_spec, inner, mode, local))
            gather_or_raise(None, error, group)
            assert kept is not None
            reduced = _allreduce_gradients(kept, params, failed, group, _comm_device(params))
            source = "all-reduce of the local gradients"
            del kept
    if want_reduced and sharded:
        # 2b. FSDP2: FSDP's own reduce-scatter, sharded gradients combined over ranks
        params = [p for _, p in inner.named_parameters() if p.requires_grad]
        reduced = _sharded_reduce(local_spec, model, mode, local, failed, maps, group, _comm_device(params))
        source = "FSDP2 reduce-scatter (per-shard L1 norms summed, max-abs maxed over ranks)"

    # 3. replicated parameter values, compared across ranks
    divergence = _divergence(inner, group, divergence_rtol)
    info = {
        "world_size": world,
        "backend": backend,
        "wrapper": kind,
        "find_unused_parameters": getattr(ddp, "find_unused_parameters", None),
        "static_graph": getattr(ddp, "static_graph", None),
        "reduce_scatter_unused_params": _fsdp_unused_setting(model) if kind == "fsdp2" else None,
        "reduced_by": source,
    }
    return merge_maps(maps, reduced, divergence, info)


def attempt(fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    """(result, None), or (None, the exception): every rank must reach the next collective."""
    try:
        return fn(), None
    except Exception as e:
        return None, e


def _rank_dependent_paths(maps: Sequence[FlowMap]) -> bool:
    """Some parameter has an autograd path on some ranks and none on others (reference variant)."""
    ref = maps[0].reference
    for s in maps[0].scenario_names:
        cells = [m.cells_of(ref, s) for m in maps]
        if not all(cells):
            continue
        for p in maps[0].trainable:
            none = [c[p].status == NONE for c in cells if p in c]
            if any(none) and not all(none):
                return True
    return False


def _same_parameters(maps: Sequence[FlowMap]) -> None:
    first = maps[0].trainable
    for r, m in enumerate(maps[1:], start=1):
        if m.trainable != first or m.scenario_names != maps[0].scenario_names:
            raise GradProbeError(
                f"rank {r} probed other parameters or scenarios than rank 0 ({len(m.trainable)} vs "
                f"{len(first)} trainable parameters): every rank must hold the same model and spec"
            )


def _failed_anywhere(maps: Sequence[FlowMap]) -> set[str]:
    """Scenarios whose run in the reference variant failed on some rank."""
    ref = maps[0].reference
    return {r.scenario for m in maps for r in m.runs if r.variant == ref and r.error is not None}


def _local_gradients(spec: ProbeSpec, model: torch.nn.Module, mode: str, local: FlowMap) -> list[Measurement]:
    """This rank's eager gradients per scenario, kept (``measure.per_term``/``per_scenario``)."""
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    terms = list(local.terms)
    with preserved(model), torch.enable_grad():
        batch = with_differentiable_inputs(spec.batch, spec.differentiable_inputs)
        if mode == "terms":
            reseed(spec.seed)
            _, _, results = per_term(
                lambda: spec.step(model, batch),
                params,
                terms,
                lambda ts: resolve_scenarios(spec.scenarios, ts),
                keep=True,
            )
        else:
            scenarios = resolve_scenarios(spec.scenarios, terms)
            results = per_scenario(
                lambda w: spec.step(model, batch, w), params, scenarios, terms, spec.seed, keep=True
            )
    return results


def _dense(g: torch.Tensor) -> torch.Tensor:
    return g.to_dense() if g.is_sparse else g


def _allreduce_gradients(
    results: list[Measurement],
    params: Sequence[torch.Tensor],
    failed: set[str],
    group: Any,
    device: torch.device,
) -> dict[str, tuple[list[str], list[float | None]] | None]:
    """Per scenario: presence agreed with an all_reduce of a mask, then the gradients all-reduced
    (``None`` as zeros where another rank has one) and divided by the world size, as DDP does."""
    world = dist.get_world_size(group)
    n = len(params)
    out: dict[str, tuple[list[str], list[float | None]] | None] = {}
    for m in results:
        ok = m.scenario not in failed and m.error is None and m.grads is not None
        flags = torch.zeros(n + 1, dtype=torch.float64, device=device)
        if ok:
            assert m.grads is not None
            flags[:n] = torch.tensor([g is not None for g in m.grads], dtype=torch.float64)
        else:
            flags[n] = 1.0
        dist.all_reduce(flags, group=group)
        counts = flags.cpu().tolist()
        if counts[n] > 0:
            out[m.scenario] = None
            m.grads = None
            continue
        assert m.grads is not None
        present = [i for i in range(n) if counts[i] > 0]
        buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i in present:
            buckets.setdefault((params[i].dtype, params[i].device), []).append(i)
        grads: list[torch.Tensor | None] = [None] * n
        for (dtype, dev), idx in buckets.items():
            parts = [
                torch.zeros_like(params[i], dtype=dtype)
                if m.grads[i] is None
                else _dense(m.grads[i]).to(dtype)  # type: ignore[union-attr]
                for i in idx
            ]
            flat = torch.cat([t.reshape(-1) for t in parts]).to(device)
            dist.all_reduce(flat, group=group)
            flat = (flat / world).to(dev)
            offset = 0
            for i in idx:
                k = params[i].numel()
                grads[i] = flat[offset : offset + k].view(params[i].shape)
                offset += k
        m.grads = None
        out[m.scenario] = reduce_grads(grads)
    return out


def _fsdp_unused_setting(model: torch.nn.Module) -> bool | None:
    values = {
        getattr(g, "reduce_scatter_unused_params", None) for _, _, gs in _fsdp_groups(model) for g in gs
    }
    values.discard(None)
    return None if not values else all(values)


def _sharded_reduce(
    spec: ProbeSpec,
    model: torch.nn.Module,
    mode: str,
    local: FlowMap,
    failed: set[str],
    maps: Sequence[FlowMap],
    group: Any,
    device: torch.device,
) -> dict[str, tuple[list[str], list[float | None]] | None]:
    """FSDP2: one forward and ``backward()`` per scenario through FSDP's own reduce-scatter, then the
    statuses of the sharded gradients combined over ranks: per-shard L1 norms summed, per-shard
    max-abs maxed (NaN and inf counted apart), so an empty or zero shard on one rank does not make a
    parameter unreached. Only run when every rank has a gradient path to the same parameters (FSDP's
    collectives then match); a parameter with no path on any rank stays ``none`` (FSDP leaves its
    ``.grad`` unset, or zero with ``reduce_scatter_unused_params``)."""
    from torch.distributed.tensor import DTensor

    terms = list(local.terms)
    scenarios: Sequence[Scenario] = resolve_scenarios(spec.scenarios, terms)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    names_ = [n for n, _ in named]
    ref = maps[0].reference
    no_path_everywhere = {
        s.name: {p for p in names_ if all(m.cells_of(ref, s.name).get(p) is None
                                          or m.cells_of(ref, s.name)[p].status == NONE for m in maps)}
        for s in scenarios
    }  # fmt: skip
    out: dict[str, tuple[list[str], list[float | None]] | None] = {}
    saved_grads = [(p, p.grad) for p in model.parameters()]
    buffers = [
        (mod, k, b.detach().clone())
        for mod in model.modules()
        for k, b in mod._buffers.items()
        if b is not None
    ]
    modes = [(mod, mod.training) for mod in model.modules()]
    rng = save_rng()
    like = next(p.to_local() if isinstance(p, DTensor) else p for p in params)
    try:
        with _fsdp_settings(model) as groups, torch.enable_grad():
            for m, _, _ in groups:
                m.set_requires_gradient_sync(True, recurse=False)
            batch = with_differentiable_inputs(spec.batch, spec.differentiable_inputs)
            for s in scenarios:
                if s.name in failed:
                    out[s.name] = None
                    continue
                for p in params:
                    p.grad = None
                reseed(spec.seed)
                if mode == "terms":
                    values = check_terms(spec.step(model, batch), terms)
                    total = sum((values[t] for t in s.terms), torch.zeros((), device=like.device))
                else:
                    total, _ = check_total(spec.step(model, batch, make_weights(terms, s.terms, like)), terms)
                total.backward()  # type: ignore[union-attr]
                out[s.name] = _combine_shards(params, names_, no_path_everywhere[s.name], group, device)
    finally:
        for p, g in saved_grads:
            p.grad = g
        with torch.no_grad():
            for mod, k, b in buffers:
                mod._buffers[k].copy_(b)  # type: ignore[union-attr]
        for mod, training in modes:
            mod.training = training
        restore_rng(rng)
    return out


def _combine_shards(
    params: Sequence[torch.Tensor],
    names_: Sequence[str],
    no_path: set[str],
    group: Any,
    device: torch.device,
) -> tuple[list[str], list[float | None]]:
    """Statuses and L1 norms of sharded gradients over all ranks (replicated ones: rank 0's share)."""
    from torch.distributed.tensor import DTensor

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    n = len(params)
    summed = torch.zeros(4, n, dtype=torch.float64, device=device)  # present, l1, has nan, has inf
    amax = torch.zeros(n, dtype=torch.float64, device=device)
    for i, p in enumerate(params):
        g = p.grad
        if g is None:
            continue
        sharded = isinstance(g, DTensor)
        if not sharded:
            # Not managed by FSDP (ignored parameters): average it like DDP would, counted once.
            g = g.detach().clone()
            dist.all_reduce(g, group=group)
            g = g / world
        local = _dense(g.to_local() if sharded else g)
        summed[0, i] = 1.0
        if local.numel() == 0 or (not sharded and rank != 0):
            continue
        l1 = torch.linalg.vector_norm(local, 1, dtype=torch.float64)
        biggest = local.abs().max().to(torch.float64)
        summed[1, i] = l1
        summed[2, i] = torch.isnan(biggest).to(torch.float64)
        summed[3, i] = torch.isinf(biggest).to(torch.float64)
        amax[i] = torch.where(torch.isfinite(biggest), biggest, torch.zeros_like(biggest))
    dist.all_reduce(summed, group=group)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    s, a = summed.cpu().tolist(), amax.cpu().tolist()
    statuses: list[str] = []
    norms: list[float | None] = []
    for i, name in enumerate(names_):
        if s[0][i] == 0 or name in no_path:
            statuses.append(NONE)
            norms.append(None)
            continue
        statuses.append(NAN if s[2][i] > 0 else INF if s[3][i] > 0 else status_of(a[i]))
        norms.append(s[1][i])
    return statuses, norms


def _divergence(model: torch.nn.Module, group: Any, rtol: float) -> dict[str, Any]:
    """Replicated parameter values compared across ranks: (L1, sum, L2) in float64 per parameter,
    all-gathered; sharded (DTensor) parameters are skipped."""
    named = [(n, p) for n, p in model.named_parameters() if not _is_dtensor(p)]
    skipped = sum(1 for _, p in model.named_parameters() if _is_dtensor(p))
    result: dict[str, Any] = {
        "rtol": rtol,
        "checked": len(named),
        "skipped_sharded": skipped,
        "parameters": {},
    }
    if not named:
        return result
    device = _comm_device([p for _, p in named])
    with torch.no_grad():
        local = torch.stack(
            [
                torch.stack(
                    [
                        torch.linalg.vector_norm(p, 1, dtype=torch.float64),
                        torch.sum(p, dtype=torch.float64),
                        torch.linalg.vector_norm(p, 2, dtype=torch.float64),
                    ]
                ).to(device)
                for _, p in named
            ]
        )
    world = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local, group=group)
    sums = torch.stack(parts).cpu()  # (world, parameters, 3)
    base = sums[0]
    both_nan = torch.isnan(sums) & torch.isnan(base)
    scale = torch.maximum(sums.abs(), base.abs()).clamp_min(1e-300)
    rel = torch.where(both_nan | (sums == base), torch.zeros_like(sums), (sums - base).abs() / scale)
    rel = torch.nan_to_num(rel, nan=float("inf"))
    worst = rel.amax(dim=2)  # (world, parameters)
    for i, (name, _) in enumerate(named):
        column = worst[:, i].tolist()
        off = [r for r, x in enumerate(column) if x > rtol]
        if off:
            result["parameters"][name] = {
                "ranks": off,
                "max_rel_diff": max(column),
                "l1": sums[:, i, 0].tolist(),
            }
    return result


# ----- merge --------------------------------------------------------------------------------------


def _combined_status(statuses: Sequence[str]) -> str:
    return next(s for s in _PRECEDENCE if s in statuses) if statuses else NONE


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(values) if present else None


def merge_maps(
    maps: Sequence[FlowMap],
    reduced: Mapping[str, tuple[list[str], list[float | None]] | None],
    divergence: Mapping[str, Any],
    info: Mapping[str, Any],
) -> FlowMap:
    """The merged flow map from every rank's local map (in rank order).

    ``reduced``: per scenario, the statuses and norms of the reduced (averaged) eager gradient, or
    None where a rank's run failed; used for the plain-eager variants' cells. Other variants' cells
    combine the ranks' statuses (NaN, inf, nonzero, zero, none: the first found on any rank) with the
    mean of the ranks' L1 norms, the largest relative error and the first verdict other than
    ``match``. Runs take the mean term values over ranks; a run failing on any rank fails.
    """
    base = maps[0]
    world = len(maps)
    trainable = list(base.trainable)
    frozen = [p.name for p in base.parameters if not p.requires_grad]
    plain_eager = {
        v.name for v in base.variants if v.capture == "eager" and v.backend is None and not v.knobs
    }
    runs: list[Run] = []
    cells: list[Cell] = []
    for run in base.runs:
        per_rank = [m.run(run.variant, run.scenario) for m in maps]
        bad = [(r, x.error) for r, x in enumerate(per_rank) if x.error is not None]
        error: RunError | None = None
        if bad:
            first = bad[0][1]
            assert first is not None
            where = "all ranks" if len(bad) == world else f"rank(s) {', '.join(str(r) for r, _ in bad)}"
            error = RunError(first.stage, first.type, f"on {where}: {first.message}")
        terms_seen = {t for x in per_rank for t in x.term_values}
        values = {
            t: _mean([x.term_values.get(t) for x in per_rank]) if all(x.term_values.get(t) is not None
                                                                    for x in per_rank) else None
            for t in run.term_values if t in terms_seen
        }  # fmt: skip
        totals = [x.total for x in per_rank]
        total = _mean(totals) if all(t is not None for t in totals) else None
        runs.append(
            Run(run.variant, run.scenario, values, total, error, max(x.seconds for x in per_rank),
                run.compiled_graphs)
        )  # fmt: skip
        if error is not None:
            continue
        is_ref = run.variant == base.reference
        red = reduced.get(run.scenario) if run.variant in plain_eager else None
        rank_cells = [m.cells_of(run.variant, run.scenario) for m in maps]
        for i, name in enumerate(trainable):
            here = [rc.get(name) for rc in rank_cells]
            statuses = [c.status if c is not None else NONE for c in here]
            if red is not None:
                status, norm = red[0][i], red[1][i]
            else:
                status = _combined_status(statuses)
                norm = _mean([c.norm if c is not None else None for c in here])
            rel: float | None = None
            verdict: str | None = None
            if not is_ref:
                errors = [c.rel_error for c in here if c is not None and c.rel_error is not None]
                rel = max(errors) if errors else None
                verdicts = [c.verdict for c in here if c is not None and c.verdict is not None]
                verdict = next((v for v in verdicts if v != "match"), verdicts[0] if verdicts else None)
            cells.append(Cell(run.variant, run.scenario, name, status, norm, rel, verdict))
        cells.extend(Cell(run.variant, run.scenario, p, NONE, None) for p in frozen)

    detail = dict(info)
    detail.update(_rank_detail(maps))
    detail["divergence"] = dict(divergence)
    detail["norms"] = (
        "plain-eager variants: L1 norms of the gradient all-reduced and averaged over ranks"
        + (" (FSDP2: summed over shards)" if info.get("wrapper") == "fsdp2" else "")
        + "; other variants: mean of the ranks' local L1 norms"
    )
    checks = dict(base.checks)
    checks["distributed"] = detail
    variants = tuple(
        msgspec.structs.replace(v, seconds=max(m.variant(v.name).seconds for m in maps))
        if isinstance(v, VariantInfo)
        else v
        for v in base.variants
    )
    warnings = tuple(dict.fromkeys(w for m in maps for w in m.warnings))
    merged = msgspec.structs.replace(
        base,
        runs=tuple(runs),
        cells=tuple(cells),
        checks=checks,
        variants=variants,
        warnings=warnings,
        findings=(),
    )
    return msgspec.structs.replace(merged, findings=tuple(diagnose_map(merged)))


def _rank_detail(maps: Sequence[FlowMap]) -> dict[str, Any]:
    """Which ranks reach each parameter (reference variant, and others), and which have no path."""
    base = maps[0]
    ref = base.reference

    def reach(variant: str) -> tuple[dict[str, dict[str, list[int]]], dict[str, dict[str, list[int]]]]:
        ranks: dict[str, dict[str, list[int]]] = {}
        no_path: dict[str, dict[str, list[int]]] = {}
        for s in base.scenario_names:
            if any(m.run(variant, s).error is not None for m in maps):
                continue
            cells = [m.cells_of(variant, s) for m in maps]
            ranks[s] = {
                p: [r for r, c in enumerate(cells) if p in c and c[p].status == NONZERO]
                for p in base.trainable
            }
            gaps = {
                p: [r for r, c in enumerate(cells) if p not in c or c[p].status == NONE]
                for p in base.trainable
            }
            no_path[s] = {p: rs for p, rs in gaps.items() if rs}
        return ranks, no_path

    ranks, no_path = reach(ref)
    out: dict[str, Any] = {
        "reference": ref,
        "ranks": ranks,
        "no_path": no_path,
        "reached_per_rank": {
            s: [len(m.reached(ref, s)) for m in maps] for s in base.scenario_names if s in ranks
        },
        "failed": {
            s: [r for r, m in enumerate(maps) if m.run(ref, s).error is not None]
            for s in base.scenario_names
            if s not in ranks
        },
    }
    others = [v for v in base.variant_names if v != ref]
    if others:
        out["ranks_by_variant"] = {v: reach(v)[0] for v in others}
    return out
