"""Beyond reachability: why a term that reaches its parameters can still stay flat.

From the reference variant's per-term gradients (taken at the prefactors the step applies):

* balance: per term and parameter group, the L2 norm of the term's gradient and its share of the
  groups' total — a term drowned by another (term-dominated) and the prefactor change that balances it;
* conflict: cosine similarity between terms' gradients over shared parameters, per group and overall,
  and whether each term is a derivative (its value computed from a gradient taken inside the step with
  create_graph, as forces and virials are from the energy): two derivatives of one energy conflict by
  construction, which is no evidence of harm;
* optimizer audit: parameters a term reaches that are in no optimizer group or in a group with lr 0,
  frozen parameters a term would reach, and the effect of gradient clipping on each term;
* effective update: one optimizer step per term alone vs all terms together (on a copy): with Adam the
  update is not proportional to the gradient, so a small term can be normalised away.

Groups are top-level modules (``fitting``, ``descriptor``; top-level parameters are their own group).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from .copies import working_model
from .errors import GradProbeError
from .evidence.lineage import tensors_in
from .measure import gradients_of
from .optim import Plan, fresh_optimizer, plan
from .scenarios import Scenario
from .spec import ProbeSpec

DOMINATED_SHARE = 0.01
CONFLICT_COSINE = -0.5


def group_of(name: str) -> str:
    return name.split(".", 1)[0]


def _per_term_grads(scenarios: Sequence[Scenario], reference: Mapping[str, Any]) -> dict[str, list]:
    out = {}
    for s in scenarios:
        m = reference.get(s.name)
        if len(s.terms) == 1 and m is not None and m.grads is not None:
            out[s.terms[0]] = m.grads
    return out


def balance_report(
    spec: ProbeSpec,
    model: torch.nn.Module,
    names: Sequence[str],
    scenarios: Sequence[Scenario],
    reference: Mapping[str, Any],
    call_terms: Any,
) -> dict[str, Any]:
    """Balance, conflict, optimizer audit, clipping and effective update; plain data for the flow map."""
    grads = _per_term_grads(scenarios, reference)
    terms = list(grads)
    groups = sorted({group_of(n) for n in names}, key=[group_of(n) for n in names].index)
    index = {g: [i for i, n in enumerate(names) if group_of(n) == g] for g in groups}
    sq = {t: _squared_norms(gs) for t, gs in grads.items()}
    norms = {t: {g: math.sqrt(sum(sq[t][i] for i in index[g])) for g in groups} for t in terms}
    shares = {
        t: {g: norms[t][g] / total if (total := sum(norms[u][g] for u in terms)) > 0 else 0.0 for g in groups}
        for t in terms
    }
    result: dict[str, Any] = {
        "groups": groups,
        "norms": norms,
        "shares": shares,
        "dominated": _dominated(terms, groups, norms, shares),
        "conflicts": _conflicts(terms, groups, index, grads, norms),
    }
    if spec.prefactor_schedule:
        result["prefactor_schedule"] = dict(spec.prefactor_schedule)
        _at_limit(result["dominated"], spec.prefactor_schedule, terms, norms)
    # Each part below may fail on its own (the step raising on a later call, an optimizer that cannot
    # step a copy): it is recorded under "errors" and the parts that ran stand.
    errors: dict[str, str] = {}
    params = [p for p in model.parameters() if p.requires_grad]
    the_plan = _part("optimizer", lambda: plan(spec, model), errors)
    if the_plan is not None and the_plan.given:
        result["optimizer"] = _part(
            "optimizer audit", lambda: _optimizer_audit(the_plan, names, params, grads), errors
        )
    else:
        result["optimizer"] = None
    # One more call of the step serves both: frozen parameters a term would reach, and (only when terms
    # conflict) which terms are derivatives.
    want_derived = bool(result["conflicts"])
    frozen_and_derived = _part(
        "frozen parameters" + (" and derivatives" if want_derived else ""),
        lambda: _frozen_and_derived(model, terms, call_terms, want_derived),
        errors,
    )
    frozen, derived = frozen_and_derived or ({}, None)
    result["frozen"] = frozen
    if derived is not None:
        result["derivatives"] = sorted(derived)
        for c in result["conflicts"]:
            c["derived"] = [t in derived for t in c["terms"]]
    if spec.clip_grad_norm is not None:
        result["clipping"] = _part(
            "clipping", lambda: _clipping(spec.clip_grad_norm, terms, grads, sq), errors
        )
    if the_plan is not None:
        result["effective_update"] = _part(
            "effective update", lambda: _effective_update(spec, model, the_plan, terms, grads), errors
        )
    if errors:
        where = errors.pop("__where__", None)
        result["errors"] = errors
        if where:
            result["errors_where"] = where
    return result


def _at_limit(
    dominated: list[dict[str, Any]], schedule: Mapping[str, Any], terms: list[str], norms: dict
) -> None:
    """A drowned term's share at the end of the prefactor schedule: gradients scale with their
    prefactor, so each term's norm is moved by limit/now (a schedule that starts a term small on
    purpose, DeePMD's start_pref_e = 0.02 against start_pref_f = 1000, is no imbalance to warn about)."""
    now, limit = schedule.get("now") or {}, schedule.get("limit") or {}
    scale = {t: (limit[t] / now[t]) if now.get(t) and t in limit else 1.0 for t in terms}
    for d in dominated:
        g = d["group"]
        mine = norms[d["term"]][g] * scale[d["term"]]
        total = sum(norms[u][g] * scale[u] for u in terms)
        d["share_at_limit"] = mine / total if total > 0 else 0.0


def _part(name: str, run: Callable[[], Any], errors: dict[str, str]) -> Any:
    """``run()``, or None with the failure recorded under ``name`` (bad input still raises)."""
    try:
        return run()
    except GradProbeError:
        raise
    except Exception as e:
        from .frames import user_frame_of

        text = str(e).strip()
        errors[name] = f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"
        where = user_frame_of(e)
        if where is not None:  # the user's frame, kept beside the message (``errors_where``)
            errors.setdefault("__where__", {})[name] = where  # type: ignore[index]
        return None


def _squared_norms(gs: Sequence[torch.Tensor | None]) -> list[float]:
    present = [(i, g) for i, g in enumerate(gs) if g is not None]
    out = [0.0] * len(gs)
    if present:
        values = torch.stack([torch.linalg.vector_norm(g.double()) ** 2 for _, g in present]).cpu().tolist()
        for (i, _), v in zip(present, values, strict=True):
            out[i] = v
    return out


def _dominated(terms: list[str], groups: list[str], norms: dict, shares: dict) -> list[dict[str, Any]]:
    out = []
    for t in terms:
        reached = [g for g in groups if norms[t][g] > 0]
        if not reached or any(shares[t][g] >= DOMINATED_SHARE for g in reached):
            continue
        best = max(reached, key=lambda g: shares[t][g])
        others = {u: norms[u][best] for u in terms if u != t}
        dominant = max(others, key=others.get)  # type: ignore[arg-type]
        # Multiplying t's prefactor by k gives it a share k n_t / (k n_t + rest); k for a 10 % share:
        rest = sum(others.values())
        factor = (0.1 / 0.9) * rest / norms[t][best]
        out.append({
            "term": t, "by": dominant, "group": best, "share": shares[t][best], "prefactor_factor": factor,
            # every other term's share in that group, largest first: what the drowned term is up against
            "others": {u: shares[u][best] for u in sorted(others, key=others.get, reverse=True)},  # type: ignore[arg-type]
        })  # fmt: skip
    return out


def _conflicts(
    terms: list[str], groups: list[str], index: dict, grads: dict, norms: dict
) -> list[dict[str, Any]]:
    out = []
    for a_i, a in enumerate(terms):
        for b in terms[a_i + 1 :]:
            per_group, dot_all, na_all, nb_all = {}, 0.0, 0.0, 0.0
            for g in groups:
                dots = [
                    float((grads[a][i].double() * grads[b][i].double()).sum())
                    for i in index[g]
                    if grads[a][i] is not None and grads[b][i] is not None
                ]
                if not dots or norms[a][g] == 0 or norms[b][g] == 0:
                    continue
                dot = sum(dots)
                per_group[g] = dot / (norms[a][g] * norms[b][g])
                dot_all += dot
                na_all += norms[a][g] ** 2
                nb_all += norms[b][g] ** 2
            if per_group:
                overall = dot_all / math.sqrt(na_all * nb_all) if na_all and nb_all else 0.0
                out.append({"terms": [a, b], "cosine": overall, "groups": per_group})
    return out


class _Derivation(TorchDispatchMode):
    """Marks every tensor computed inside a backward pass (autograd's graph task is running: the step's
    own ``autograd.grad(..., create_graph=True)``) and every tensor computed from one. Needs nothing from
    the step: the engine says when it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.marked: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inside = torch._C._current_graph_task_id() != -1
        if inside or any(a in self.marked for a in tensors_in((args, kwargs))):
            for t in tensors_in(out):
                self.marked[t] = True
        return out

    def terms_marked(self, values: Mapping[str, Any], terms: Sequence[str]) -> set[str]:
        """The terms whose value is a marked tensor: a derivative."""
        return {t for t in terms if isinstance(values.get(t), torch.Tensor) and values[t] in self.marked}


def derivative_terms(call_terms: Callable[[], Mapping[str, Any]], terms: Sequence[str]) -> set[str]:
    """The terms whose value is computed from a gradient taken inside the step (one recorded call)."""
    mode = _Derivation()
    with mode:
        values = call_terms()
    return mode.terms_marked(values, terms)


def _optimizer_audit(
    the_plan: Plan, names: Sequence[str], params: list[torch.Tensor], grads: dict
) -> dict[str, Any]:
    reached = {
        names[i]: [t for t, gs in grads.items() if gs[i] is not None and bool(gs[i].abs().max() > 0)]
        for i in range(len(params))
    }
    groups = dict(zip(names, the_plan.groups, strict=True))
    missing = {n: ts for n, ts in reached.items() if ts and groups[n] is None}
    zero_lr = {
        n: ts for n, ts in reached.items() if ts and (g := groups[n]) is not None and g.get("lr", 1.0) == 0
    }
    return {"optimizer": the_plan.cls.__name__, "not_in_optimizer": missing, "zero_lr": zero_lr}


def _frozen_and_derived(
    model: torch.nn.Module, terms: list[str], call_terms: Any, want_derived: bool
) -> tuple[dict[str, list[str]], set[str] | None]:
    """Frozen parameters each term would reach (unfrozen for one call, restored here) and, if asked,
    the terms that are derivatives (``derivative_terms``), from at most one call of the step."""
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    if call_terms is None or not (frozen or want_derived):
        return {}, None
    mode = _Derivation() if want_derived else contextlib.nullcontext()
    for _, p in frozen:
        p.requires_grad_(True)
    try:
        with mode:
            values = call_terms()
        out: dict[str, list[str]] = {}
        for t in terms if frozen else ():
            if t not in values or not values[t].requires_grad:
                continue
            gs = gradients_of(values[t], [p for _, p in frozen], retain_graph=True)
            needed = [
                n for (n, _), g in zip(frozen, gs, strict=True) if g is not None and bool(g.abs().max() > 0)
            ]
            if needed:
                out[t] = needed
        return out, mode.terms_marked(values, terms) if isinstance(mode, _Derivation) else None
    finally:
        for _, p in frozen:
            p.requires_grad_(False)


def _clipping(max_norm: float, terms: list[str], grads: dict, sq: dict) -> dict[str, Any]:
    """clip_grad_norm_ scales the joint gradient by s; a term alone would be scaled by s_t. s / s_t is
    how much training together shrinks the term's update compared with training it alone. The joint
    norm is summed one parameter at a time (never a copy of the whole joint gradient)."""
    n = len(next(iter(grads.values())))
    total_sq = 0.0
    for i in range(n):
        present = [grads[t][i] for t in terms if grads[t][i] is not None]
        if present:
            total_sq += float(torch.linalg.vector_norm(sum(g.double() for g in present)) ** 2)
    total = math.sqrt(total_sq)
    scale = min(1.0, max_norm / total) if total > 0 else 1.0
    per_term = {}
    for t in terms:
        alone = math.sqrt(sum(sq[t]))
        alone_scale = min(1.0, max_norm / alone) if alone > 0 else 1.0
        per_term[t] = {"norm": alone, "scale_alone": alone_scale, "relative_update": scale / alone_scale}
    return {"max_norm": max_norm, "total_norm": total, "scale": scale, "terms": per_term}


def _effective_update(
    spec: ProbeSpec, model: torch.nn.Module, the_plan: Plan, terms: list[str], grads: dict
) -> dict[str, Any]:
    """One optimizer step per term alone and for all together, from the model's parameters; cosine of
    each term's update with the joint update over the parameters the term reaches, and the norm ratio.

    An optimizer that treats each tensor on its own (``optim.SEPARABLE``: Adam, SGD, ...) is stepped
    one parameter tensor at a time, on a copy of that tensor: the same updates, with memory for one
    tensor's copy and state instead of the model's. Others are stepped on a copy of the whole model, or,
    when it cannot be copied, on the model itself, its state put back after (``on``, ``why``).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    on_model: str | None = None
    dots = dict.fromkeys(terms, 0.0)
    alone_sq = dict.fromkeys(terms, 0.0)
    joint_sq = dict.fromkeys(terms, 0.0)

    def fold(i: int, joint: torch.Tensor, alone: dict[str, torch.Tensor]) -> None:
        for t, u in alone.items():
            dots[t] += float((u * joint).sum())
            alone_sq[t] += float((u * u).sum())
            joint_sq[t] += float((joint * joint).sum())

    def joint_grad(i: int) -> torch.Tensor | None:
        present = [grads[t][i] for t in terms if grads[t][i] is not None]
        return None if not present else sum(present[1:], present[0].clone())

    if the_plan.separable:
        for i, p in enumerate(params):
            if all(grads[t][i] is None for t in terms) or (the_plan.given and the_plan.groups[i] is None):
                continue  # no term reaches it, or the user's optimizer does not step it: no update
            q = p.detach().clone()

            def step_one(
                g: torch.Tensor, q: torch.Tensor = q, p: torch.Tensor = p, i: int = i
            ) -> torch.Tensor:
                with torch.no_grad():
                    q.copy_(p)
                q.grad = g.detach().clone()
                the_plan.on([q], [i]).step()
                q.grad = None
                return (q - p.detach()).double()

            joint = step_one(joint_grad(i))  # type: ignore[arg-type]
            fold(i, joint, {t: step_one(grads[t][i]) for t in terms if grads[t][i] is not None})
    else:
        with working_model(model) as (copy_model, on_model):
            copies = [p for p in copy_model.parameters() if p.requires_grad]
            if copy_model is model:  # stepped in place: each step starts from the values taken here
                params = [p.detach().clone() for p in params]

            def step_all(grad_list: list[torch.Tensor | None]) -> list[torch.Tensor]:
                with torch.no_grad():
                    for q, p in zip(copies, params, strict=True):
                        q.copy_(p)
                opt = fresh_optimizer(spec, copies, copy_model)
                for q, g in zip(copies, grad_list, strict=True):
                    q.grad = None if g is None else g.detach().clone()
                opt.step()
                for q in copies:
                    q.grad = None
                return [(q.detach() - p.detach()).double() for q, p in zip(copies, params, strict=True)]

            joint_all = step_all([joint_grad(i) for i in range(len(params))])
            for t in terms:
                alone_all = step_all(grads[t])
                for i, (u, j) in enumerate(zip(alone_all, joint_all, strict=True)):
                    if grads[t][i] is not None:
                        fold(i, j, {t: u})
    out = {
        t: {
            "cosine_with_joint": dots[t] / math.sqrt(alone_sq[t] * joint_sq[t])
            if alone_sq[t] and joint_sq[t]
            else 0.0,
            "norm_alone": math.sqrt(alone_sq[t]),
            "norm_joint": math.sqrt(joint_sq[t]),
        }
        for t in terms
    }
    result: dict[str, Any] = {"optimizer": the_plan.cls.__name__, "terms": out}
    if on_model is not None:
        result["on"], result["why"] = "the model itself", on_model
    return result
