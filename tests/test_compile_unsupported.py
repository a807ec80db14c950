"""compile-unsupported: dynamo recorded that it could not compile a path's frames, and no compiled code
ran in any of the path's runs. Measured on torch 2.13 with an ``nn.GRU`` (dynamo's ``allow_rnn`` is
off): ``torch.compile`` of the model runs it eagerly, with an ``Unsupported`` failed compile in dynamo's
own record; a later compile of the same code records nothing (dynamo does not try it again). Before,
the user's compiled trainer read "OK: no problem found" (it was eager all along) and a
``compile_model`` variant read "recompile-per-scenario ... cause not known".
"""

from __future__ import annotations

import torch
from torch import nn

import gradprobe
from gradprobe.claims import audit
from gradprobe.variants import user_variant


class Scorer(nn.Module):
    """A GRU over token embeddings with a tagging head and a next-token head (another style than the zoo)."""

    def __init__(self) -> None:
        super().__init__()
        self.vocab = nn.Embedding(30, 12)
        self.rnn = nn.GRU(12, 12, batch_first=True)
        self.tags = nn.Linear(12, 4)
        self.next = nn.Linear(12, 30)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, _ = self.rnn(self.vocab(tokens))
        return self.tags(h), self.next(h)


def terms(m: nn.Module, b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    tags, nxt = m(b["tokens"])
    ce = nn.functional.cross_entropy
    return {
        "tag": ce(tags.flatten(0, 1), b["tags"].flatten()),
        "lm": ce(nxt[:, :-1].flatten(0, 1), b["tokens"][:, 1:].flatten()),
    }


def sentences() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(6)
    return {
        "tokens": torch.randint(0, 30, (3, 6), generator=g),
        "tags": torch.randint(0, 4, (3, 6), generator=g),
    }


def compiled_trainer(ctx):  # type: ignore[no-untyped-def]
    """The user's own training path: the model compiled, the loss eager around it."""
    compiled = torch.compile(ctx.model, backend="aot_eager")

    def run(batch, weights):  # type: ignore[no-untyped-def]
        t = ctx.step(compiled, batch)
        return sum(weights[k] * t[k] for k in t), t

    return run


def test_a_user_trainer_that_dynamo_cannot_compile_is_said_to_run_eager() -> None:
    torch._dynamo.reset()  # a fresh process's dynamo: Scorer.forward not tried before
    torch.manual_seed(0)
    fm = gradprobe.probe(Scorer(), terms, sentences(), terms=["tag", "lm"],
                         variants=["eager", user_variant("trainer", compiled_trainer)], progress=False)  # fmt: skip
    (f,) = [f for f in fm.findings if f.cause == "compile-unsupported"]
    assert f.severity == "warning" and not fm.errors(), gradprobe.render(fm)
    assert f.message.startswith("trainer: dynamo could not compile forward (test_compile_unsupported.py:")
    assert "Unsupported: Attempted to wrap RNN, GRU, or LSTM" in f.message
    assert "no compiled code ran in tag only, lm only, all" in f.message
    assert (
        f.fix.startswith("dynamo's own hint: Set torch._dynamo.config.allow_rnn=True")
        and "(not tried)" in f.fix
    )
    assert f.location["line"] == Scorer.forward.__code__.co_firstlineno
    assert audit(fm) == []


def eager_trainer(ctx):  # type: ignore[no-untyped-def]
    """The user's own path that compiles nothing."""

    def run(batch, weights):  # type: ignore[no-untyped-def]
        t = ctx.step(ctx.model, batch)
        return sum(weights[k] * t[k] for k in t), t

    return run


def test_a_later_compile_of_the_same_frame_names_the_record_of_the_first() -> None:
    """Only the path that compiles for sure borrows the record: not make_fx, not a user's eager path."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    variants = ["eager", "make_fx", "compile:aot_eager", "compile_model:aot_eager",
                user_variant("plain_trainer", eager_trainer)]  # fmt: skip
    fm = gradprobe.probe(Scorer(), terms, sentences(), terms=["tag", "lm"], variants=variants, progress=False)
    (f,) = [f for f in fm.findings if f.cause == "compile-unsupported"]
    assert f.severity == "error" and f.message.startswith(
        "compile_model:aot_eager: dynamo could not compile forward"
    )
    assert "(recorded in compile:aot_eager's run" in f.message
    assert not [f for f in fm.findings if f.cause in ("recompile-per-scenario", "run-failed")], (
        gradprobe.render(fm)
    )
    assert audit(fm) == []


class TwoLayer(nn.Module):
    """Its own forward: dynamo caches compiled code per code object, and a compile of ``nn.Sequential``'s
    here would be what a later test's compile of another ``nn.Sequential`` finds."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.outer = nn.Linear(3, 5), nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.tanh(self.inner(x)))


def test_a_path_that_ran_compiled_code_is_not_this() -> None:
    torch.manual_seed(0)
    model = TwoLayer()
    fm = gradprobe.probe(model, lambda m, x: {"fit": m(x).square().mean(), "l2": next(m.parameters()).square().sum()},
                         torch.randn(4, 3), variants="eager,compile_model:aot_eager", progress=False)  # fmt: skip
    assert not [f for f in fm.findings if f.cause == "compile-unsupported"] and not fm.errors()
