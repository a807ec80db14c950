"""A tiny causal self-attention tagger: token embedding, one attention layer, and two heads.

Terms: ``tag`` (per-token classification) and ``lm`` (next-token prediction). float32; integer
token and tag batches.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import gradprobe

from . import (
    Case,
    Names,
    Setup,
    case_file,
    fresh,
    grads,
    is_cut,
    nudge,
    opaque,
    seeded,
    term_weights,
    user_run,
    weighted_total,
    with_twin,
)

FILE = case_file()
FAMILY = "text_tagger"
VOCAB, TAGS, DIM, BATCH, LENGTH = 12, 4, 8, 4, 7


class Tagger(nn.Module):
    def __init__(self, n: Names, aux_head: bool = False) -> None:
        super().__init__()
        self.names = {base: n.attr(base) for base in ("tok", "qkv", "tag_head", "lm_head", "aux_head")}
        setattr(self, self.names["tok"], nn.Embedding(VOCAB, DIM))
        setattr(self, self.names["qkv"], nn.Linear(DIM, 3 * DIM))
        setattr(self, self.names["tag_head"], nn.Linear(DIM, TAGS))
        setattr(self, self.names["lm_head"], nn.Linear(DIM, VOCAB))
        if aux_head:  # a part-of-speech head kept for a later stage: no term trains it yet
            setattr(self, self.names["aux_head"], nn.Linear(DIM, 3))

    def sub(self, base: str) -> nn.Module:
        return getattr(self, self.names[base])

    def encode(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.sub("tok")(tokens)
        q, k, v = self.sub("qkv")(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(DIM)
        future = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool).triu(1)
        return x + scores.masked_fill(future, float("-inf")).softmax(-1) @ v

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.encode(tokens)
        return self.sub("tag_head")(h), self.sub("lm_head")(h)


def _keys(n: Names) -> tuple[str, str]:
    return n.key("tokens"), n.key("tags")


def _terms(n: Names) -> tuple[str, str]:
    return n.term("tag"), n.term("lm")


def _batch(n: Names, seed: int) -> dict[str, torch.Tensor]:
    kt, kg = _keys(n)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(VOCAB, (BATCH, LENGTH), generator=g)
    return {kt: tokens, kg: (tokens * 7 + 1) % TAGS}


def _model(n: Names, **kw) -> Tagger:
    with seeded(3):
        return Tagger(n, **kw)


def tag_loss(tag_logits: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(tag_logits.reshape(-1, TAGS), tags.reshape(-1))


def next_token_loss(lm_logits: torch.Tensor, tokens: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return nn.functional.cross_entropy(
        lm_logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), reduction=reduction
    )


def confidence(tag_logits: torch.Tensor) -> torch.Tensor:
    """The tagger's mean top-class probability: the lm term is weighted by it (a curriculum)."""
    return tag_logits.softmax(-1).amax(-1).mean()


def _step(n: Names, weighted_lm: bool = False):
    kt, kg = _keys(n)
    tt, tl = _terms(n)

    def step(model, batch):
        tag_logits, lm_logits = model(batch[kt])
        lm = next_token_loss(lm_logits, batch[kt])
        if weighted_lm:
            lm = confidence(tag_logits) * lm
        return {tt: tag_loss(tag_logits, batch[kg]), tl: lm}

    return step


def _spec(n: Names, step, model: Tagger | None = None, **extra) -> gradprobe.ProbeSpec:
    return gradprobe.ProbeSpec(
        model=model if model is not None else _model(n),
        step=step,
        batch=_batch(n, 0),
        terms=list(_terms(n)),
        mode="terms",
        name=FAMILY,
        **extra,
    )


def _weights(weights, names) -> dict[str, torch.Tensor]:
    return {t: weights[t] for t in names}


# ----- tagger-item-conf: the trainer weighs lm by the tagger's confidence as a Python number ----------


def build_item_conf(n: Names, bug: bool) -> Setup:
    kt, kg = _keys(n)
    tt, tl = _terms(n)

    def make_run(ctx):
        m = ctx.model

        def losses(batch, w):
            tag_logits, lm_logits = m(batch[kt])
            conf = confidence(tag_logits)
            scale = conf.item() if bug else conf  # BUG tagger-item-conf
            terms = {tt: tag_loss(tag_logits, batch[kg]), tl: scale * next_token_loss(lm_logits, batch[kt])}
            return weighted_total(terms, w), terms

        compiled = torch.compile(fresh(losses), backend="aot_eager")
        return lambda batch, weights: compiled(batch, _weights(weights, (tt, tl)))

    return Setup(_spec(n, _step(n, weighted_lm=True)), ["eager", opaque(n.variant("trainer"), make_run)])


def truth_item_conf(n: Names, bug: bool) -> None:
    setup = build_item_conf(n, bug)
    _, tl = _terms(n)
    model, batch = setup.spec.model, setup.spec.batch
    run = user_run(setup)
    only = term_weights(list(_terms(n)), [tl], next(model.parameters()))
    value = run(batch, only)[1][tl]
    torch.testing.assert_close(value, setup.spec.step(model, batch)[tl])
    head = model.sub("tag_head")
    got = grads(value, dict(head.named_parameters()))
    if bug:
        assert all(is_cut(g) for g in got.values()), got
        assert nudge(lambda: run(batch, only)[1][tl], head.weight, eps=1e-3) > 1e-7
    else:
        assert not any(is_cut(g) for g in got.values()), got


# ----- tagger-float-weight: the trainer turns the term weights into Python floats --------------------


def build_float_weight(n: Names, bug: bool) -> Setup:
    kt, kg = _keys(n)
    tt, tl = _terms(n)

    def make_run(ctx):
        m = ctx.model

        def losses(batch, w):
            tag_logits, lm_logits = m(batch[kt])
            terms = {tt: tag_loss(tag_logits, batch[kg]), tl: next_token_loss(lm_logits, batch[kt])}
            scale = {tt: float(w[tt]), tl: float(w[tl])} if bug else w  # BUG tagger-float-weight
            return weighted_total(terms, scale), terms

        compiled = torch.compile(fresh(losses), backend="eager")
        return lambda batch, weights: compiled(batch, _weights(weights, (tt, tl)))

    return Setup(_spec(n, _step(n)), ["eager", opaque(n.variant("trainer"), make_run)])


def truth_float_weight(n: Names, bug: bool) -> None:
    from torch._dynamo.utils import counters

    setup = build_float_weight(n, bug)
    model, batch = setup.spec.model, setup.spec.batch
    run = user_run(setup)
    names = list(_terms(n))
    run(batch, term_weights(names, names[:1], next(model.parameters())))
    before = counters["stats"]["unique_graphs"]
    for on in (names[1:], names):  # the later scenarios
        run(batch, term_weights(names, on, next(model.parameters())))
    again = counters["stats"]["unique_graphs"] - before
    assert (again > 0) if bug else (again == 0), again


# ----- tagger-dead-lm: the step feeds the smoothed targets where the logits belong ------------------


def smoothed(tokens: torch.Tensor, eps: float = 0.1) -> torch.Tensor:
    return nn.functional.one_hot(tokens[:, 1:], VOCAB).float() * (1 - eps) + eps / VOCAB


def build_dead_lm(n: Names, bug: bool) -> Setup:
    kt, kg = _keys(n)
    tt, tl = _terms(n)

    def step(model, batch):
        tag_logits, lm_logits = model(batch[kt])
        target = smoothed(batch[kt])
        logits = target.log() if bug else lm_logits[:, :-1]  # BUG tagger-dead-lm
        lm = -(target * logits.log_softmax(-1)).sum(-1).mean()
        return {tt: tag_loss(tag_logits, batch[kg]), tl: lm}

    return Setup(_spec(n, step), ["eager"])


def truth_dead_lm(n: Names, bug: bool) -> None:
    setup = build_dead_lm(n, bug)
    _, tl = _terms(n)
    model, batch = setup.spec.model, setup.spec.batch
    params = dict(model.named_parameters())
    value = setup.spec.step(model, batch)[tl]
    if bug:
        assert not value.requires_grad
        assert all(
            nudge(lambda: setup.spec.step(model, batch)[tl], p, eps=1e-2) == 0.0 for p in params.values()
        )
    else:
        assert not is_cut(grads(value, params)[model.names["lm_head"] + ".weight"])


# ----- tagger-lr0-lm: heads fine-tuned on a frozen encoder; the lm head's group has lr 0 -------------


def build_lr0_lm(n: Names, bug: bool) -> Setup:
    tagger = _model(n)
    for base in ("tok", "qkv"):
        tagger.sub(base).requires_grad_(False)  # a frozen, pretrained encoder
    lm_lr = 0.0 if bug else 0.5  # BUG tagger-lr0-lm

    def optimizer(model):
        return torch.optim.SGD(
            [
                {"params": model.sub("tag_head").parameters(), "lr": 0.5},
                {"params": model.sub("lm_head").parameters(), "lr": lm_lr},
            ]
        )

    spec = _spec(n, _step(n), model=tagger, optimizer=optimizer)
    return Setup(spec, ["eager"], checks=("training",))


def truth_lr0_lm(n: Names, bug: bool) -> None:
    import copy

    setup = build_lr0_lm(n, bug)
    _, tl = _terms(n)
    model = copy.deepcopy(setup.spec.model)
    opt = setup.spec.optimizer(model)  # type: ignore[misc]
    curve = []
    for _ in range(6):
        value = setup.spec.step(model, setup.spec.batch)[tl]
        curve.append(float(value.detach()))
        opt.zero_grad()
        value.backward()
        opt.step()
    if bug:
        assert max(curve) - min(curve) == 0.0, curve
    else:
        assert curve[-1] < curve[0] - 1e-3, curve


# ----- healthy: an auxiliary head that no term uses yet -------------------------------------------------


def build_aux_healthy(n: Names) -> Setup:
    return Setup(_spec(n, _step(n), model=_model(n, aux_head=True)), ["eager"])


def truth_aux_healthy(n: Names) -> None:
    setup = build_aux_healthy(n)
    model, batch = setup.spec.model, setup.spec.batch
    aux = model.sub("aux_head")
    for term, value in setup.spec.step(model, batch).items():
        assert all(g is None for g in grads(value, dict(aux.named_parameters())).values())
        assert nudge(lambda t=term: setup.spec.step(model, batch)[t], aux.weight) == 0.0


CASES: list[Case] = [
    *with_twin(
        Case(
            "tagger-item-conf",
            FAMILY,
            "item",
            "opaque-compiled",
            build=build_item_conf,
            expect=frozenset({"graph-break-in-model"}),
            where="tagger-item-conf",
            notes="lm is weighted by conf.item(): lm's value depends on the tag head, its gradient does not",
            file=FILE,
        ),
        build_item_conf,
        truth_item_conf,
    ),
    *with_twin(
        Case(
            "tagger-float-weight",
            FAMILY,
            "float-weight",
            "opaque-compiled",
            build=build_float_weight,
            expect=frozenset({"recompile-per-scenario"}),
            where="tagger-float-weight",
            notes="float(w[t]) in the compiled loss: dynamo specialises on each scenario's weights",
            file=FILE,
        ),
        build_float_weight,
        truth_float_weight,
    ),
    *with_twin(
        Case(
            "tagger-dead-lm",
            FAMILY,
            "dead-term",
            "reference",
            build=build_dead_lm,
            expect=frozenset({"dead-term"}),
            notes="the smoothed targets are fed where the logits belong: lm depends on no parameter",
            file=FILE,
        ),
        build_dead_lm,
        truth_dead_lm,
    ),
    *with_twin(
        Case(
            "tagger-lr0-lm",
            FAMILY,
            "lr0",
            "reference",
            build=build_lr0_lm,
            expect=frozenset({"term-not-decreasing"}),
            notes="heads fine-tuned on a frozen encoder; the lm head's group has lr 0, so lm stays flat",
            file=FILE,
        ),
        build_lr0_lm,
        truth_lr0_lm,
    ),
    Case(
        "tagger-aux-healthy",
        FAMILY,
        "unused-head",
        "reference",
        build=build_aux_healthy,
        healthy=True,
        truth=truth_aux_healthy,
        notes="an auxiliary head no term uses yet: unreached, legitimately (info at most)",
        file=FILE,
    ),
]
