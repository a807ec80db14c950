"""Beyond reachability: why a term that reaches its parameters can still stay flat.

From the reference variant's per-term gradients (taken at the prefactors the step applies):

* balance: per term and parameter group, the L2 norm of the term's gradient and its share of the
  groups' total — a term drowned by another (term-dominated) and the prefactor change that balances it;
* conflict: cosine similarity between terms' gradients over shared parameters, per group and overall;
* optimizer audit: parameters a term reaches that are in no optimizer group or in a group with lr 0,
  frozen parameters a term would reach, and the effect of gradient clipping on each term;
* effective update: one optimizer step per term alone vs all terms together (on a copy): with Adam the
  update is not proportional to the gradient, so a small term can be normalised away.

Groups are top-level modules (``fitting``, ``descriptor``; top-level parameters are their own group).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .optim import call_optimizer_factory, fresh_optimizer
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
    params = [p for p in model.parameters() if p.requires_grad]
    result["optimizer"] = _optimizer_audit(spec, model, names, params, grads)
    result["frozen"] = _frozen_needed(model, terms, call_terms)
    if spec.clip_grad_norm is not None:
        result["clipping"] = _clipping(spec.clip_grad_norm, terms, grads, sq)
    result["effective_update"] = _effective_update(spec, model, terms, grads)
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
        out.append(
            {"term": t, "by": dominant, "group": best, "share": shares[t][best], "prefactor_factor": factor}
        )
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


def _optimizer_instance(
    spec: ProbeSpec, params: list[torch.Tensor], model: torch.nn.Module
) -> torch.optim.Optimizer | None:
    opt = spec.optimizer
    if opt is None:
        return None
    if isinstance(opt, torch.optim.Optimizer):
        return opt  # read only: its param_groups
    return call_optimizer_factory(opt, params, model)  # built on the model's parameters; never stepped


def _optimizer_audit(
    spec: ProbeSpec, model: torch.nn.Module, names: Sequence[str], params: list[torch.Tensor], grads: dict
) -> dict[str, Any] | None:
    opt = _optimizer_instance(spec, params, model)
    if opt is None:
        return None
    groups = {id(p): g for g in opt.param_groups for p in g["params"]}
    by_id = dict(zip(map(id, params), names, strict=True))
    reached = {
        by_id[id(p)]: [t for t, gs in grads.items() if gs[i] is not None and bool(gs[i].abs().max() > 0)]
        for i, p in enumerate(params)
    }
    missing = {n: ts for n, ts in reached.items() if ts and id(params[names.index(n)]) not in groups}
    zero_lr = {
        n: ts
        for n, ts in reached.items()
        if ts and (g := groups.get(id(params[names.index(n)]))) is not None and g.get("lr", 1.0) == 0
    }
    return {"optimizer": type(opt).__name__, "not_in_optimizer": missing, "zero_lr": zero_lr}


def _frozen_needed(model: torch.nn.Module, terms: list[str], call_terms: Any) -> dict[str, list[str]]:
    """Frozen parameters each term would reach: unfrozen for one forward (restored by the caller)."""
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    if not frozen or call_terms is None:
        return {}
    for _, p in frozen:
        p.requires_grad_(True)
    try:
        values = call_terms()
        out: dict[str, list[str]] = {}
        for t in terms:
            if t not in values or not values[t].requires_grad:
                continue
            gs = torch.autograd.grad(values[t], [p for _, p in frozen], retain_graph=True, allow_unused=True)
            needed = [
                n for (n, _), g in zip(frozen, gs, strict=True) if g is not None and bool(g.abs().max() > 0)
            ]
            if needed:
                out[t] = needed
        return out
    finally:
        for _, p in frozen:
            p.requires_grad_(False)


def _clipping(max_norm: float, terms: list[str], grads: dict, sq: dict) -> dict[str, Any]:
    """clip_grad_norm_ scales the joint gradient by s; a term alone would be scaled by s_t. s / s_t is
    how much training together shrinks the term's update compared with training it alone."""
    n = len(next(iter(grads.values())))
    joint = [
        sum((grads[t][i].double() for t in terms if grads[t][i] is not None), torch.zeros(()))
        for i in range(n)
    ]
    total = math.sqrt(sum(float((j**2).sum()) for j in joint))
    scale = min(1.0, max_norm / total) if total > 0 else 1.0
    per_term = {}
    for t in terms:
        alone = math.sqrt(sum(sq[t]))
        alone_scale = min(1.0, max_norm / alone) if alone > 0 else 1.0
        per_term[t] = {"norm": alone, "scale_alone": alone_scale, "relative_update": scale / alone_scale}
    return {"max_norm": max_norm, "total_norm": total, "scale": scale, "terms": per_term}


def _effective_update(
    spec: ProbeSpec, model: torch.nn.Module, terms: list[str], grads: dict
) -> dict[str, Any]:
    """One optimizer step on a copy per term alone and for all together; cosine of each term's update
    with the joint update over the parameters the term reaches, and the norm ratio."""
    copy_model = copy.deepcopy(model)
    params = [p for p in copy_model.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in params]

    def step(grad_list: list[torch.Tensor | None]) -> list[torch.Tensor]:
        with torch.no_grad():
            for p, p0 in zip(params, start, strict=True):
                p.copy_(p0)
        opt = fresh_optimizer(spec, params, copy_model)
        for p, g in zip(params, grad_list, strict=True):
            p.grad = None if g is None else g.detach().clone()
        opt.step()
        return [(p.detach() - p0).double() for p, p0 in zip(params, start, strict=True)]

    joint_grads = [
        None if all(grads[t][i] is None for t in terms)
        else sum(grads[t][i] for t in terms if grads[t][i] is not None)  # type: ignore[misc]
        for i in range(len(params))
    ]  # fmt: skip
    joint = step(joint_grads)
    out = {}
    for t in terms:
        alone = step(grads[t])
        mask = [grads[t][i] is not None for i in range(len(params))]
        dot = sum(float((a * j).sum()) for a, j, m in zip(alone, joint, mask, strict=True) if m)
        na = math.sqrt(sum(float((a**2).sum()) for a, m in zip(alone, mask, strict=True) if m))
        nj = math.sqrt(sum(float((j**2).sum()) for j, m in zip(joint, mask, strict=True) if m))
        out[t] = {
            "cosine_with_joint": dot / (na * nj) if na and nj else 0.0,
            "norm_alone": na,
            "norm_joint": nj,
        }
    return {"optimizer": type(fresh_optimizer(spec, params, copy_model)).__name__, "terms": out}
