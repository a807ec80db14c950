"""compiler_bisect=True: past the backend ladder, torch's CompilerBisector names the decomposition.

The path is a user's own compile (an opaque registered variant) of a model with dropout under
``aot_eager_decomp_partition``: its decomposition of ``aten.native_dropout`` draws other random numbers
than eager's kernel, so the gradients differ from eager's although every run is reseeded. The ladder
names the backend; the bisector, handed the same path, names the decomposition and the op.
"""

from __future__ import annotations

import torch

import gradprobe
from gradprobe.variants import user_variant


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.drop = torch.nn.Dropout(0.3)
        self.out = torch.nn.Linear(16, 2)

    def forward(self, x):
        return self.out(self.drop(torch.tanh(self.inp(x))))


def step(model, x):
    y = model(x)
    return {"first": y[:, 0].pow(2).mean(), "second": y[:, 1].abs().mean()}


def my_compiled(ctx):
    compiled = torch.compile(ctx.model, backend="aot_eager_decomp_partition")

    def run(batch, weights):
        y = compiled(batch)
        return weights["first"] * y[:, 0].pow(2).mean() + weights["second"] * y[:, 1].abs().mean()

    return run


def _probe(**options):
    torch.manual_seed(0)
    return gradprobe.probe(
        Net(), step, torch.randn(32, 8), terms=["first", "second"],
        variants=["eager", user_variant("my_compiled", my_compiled)], diagnose=True, progress=False, **options,
    )  # fmt: skip


def test_the_compiler_bisector_names_the_decomposition_inside_the_backend():
    fm = _probe(compiler_bisect=True)
    (b,) = fm.bisections
    assert (
        b["culprit"]["backend"] == "aot_eager_decomp_partition" and b["culprit"]["last_good"] == "aot_eager"
    )
    found = b["compiler_bisect"]
    assert found["result"]["backend"] == "aot_eager_decomp_partition"
    assert found["result"]["subsystem"] == "decomposition"
    assert "native_dropout" in found["result"]["debug_info"]
    assert len(found["trials"]) >= 4 and found["seconds"] > 0
    (f,) = [f for f in fm.findings if f.cause == "backend-drops-grads"]
    assert "compiler bisector: aot_eager_decomp_partition's decomposition" in f.message
    assert "aten.native_dropout" in f.message and "aten.native_dropout" in f.fix
    assert "compiler bisection (" in b["summary"]
    # The bisector's own state is gone: a later compile uses the backend it is given.
    assert torch._inductor.compiler_bisector.CompilerBisector.get_backend() is None


def test_without_the_option_the_fix_says_how_to_ask_for_it():
    fm = _probe()
    (b,) = fm.bisections
    assert "compiler_bisect" not in b
    (f,) = [f for f in fm.findings if f.cause == "backend-drops-grads"]
    assert "compiler_bisect=True" in f.fix
