"""torch.compile's first use turns torch.distributions' argument validation off for the whole process
(dynamo's ``TorchPatcher.patch``), and with it on, ``make_fx`` cannot trace a step that builds a
distribution (the check is an ``if`` on a tensor). A probe must not let one path's compile change what a
later path or bisection trial runs: before this, a make_fx bisection after a compile "verified" that
``mode=eval`` fixed the trace. Every path of a probe that may compile runs with validation off, as in
a process that compiles; the user's setting is put back after.
"""

from __future__ import annotations

import subprocess
import sys

import torch
from torch import nn
from torch.distributions import Distribution

import gradprobe
from gradprobe.claims import audit


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 12), nn.Tanh(), nn.Linear(12, 3))
        self.baseline = nn.Linear(4, 1)


def reinforce(policy: Policy, rollout: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    dist = torch.distributions.Categorical(logits=policy.body(rollout["s"]))
    advantage = rollout["g"] - policy.baseline(rollout["s"]).squeeze(-1)
    return {
        "actor": -(dist.log_prob(rollout["a"]) * advantage.detach()).mean(),
        "baseline": advantage.pow(2).mean(),
    }


def _probe(variants: str) -> gradprobe.FlowMap:
    torch.manual_seed(5)
    rollout = {"s": torch.randn(16, 4), "a": torch.randint(0, 3, (16,)), "g": torch.randn(16)}
    return gradprobe.probe(Policy(), reinforce, rollout, variants=variants, diagnose=True, progress=False)


def test_torch_compile_turns_validation_off_for_the_process() -> None:
    """The torch fact the probe relies on (torch 2.13): if torch stops doing it, this says so."""
    code = (
        "import torch; from torch.distributions import Distribution as D; before = D._validate_args; "
        "torch.compile(lambda x: x + 1, backend='eager'); print(before, D._validate_args)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["True", "False"], out.stdout + out.stderr


def test_every_path_sees_the_same_validation_whatever_ran_before() -> None:
    saved = Distribution._validate_args
    try:
        Distribution.set_default_validate_args(True)
        compiled = _probe("eager,make_fx,compile:aot_eager")
        # Off for every path of a probe that compiles: make_fx traces and matches eager.
        assert compiled.variant("make_fx").error is None and not compiled.errors(), gradprobe.render(compiled)
        assert compiled.evidence["environment"]["distribution_validation_off"] is True
        assert Distribution._validate_args is True  # the user's setting is back
        # A probe that does not compile runs with the user's setting, though torch.compile ran in this
        # process before: make_fx fails on the check, and no bisection trial "fixes" it.
        traced = _probe("eager,make_fx")
        (f,) = [f for f in traced.findings if f.cause == "data-dependent-trace"]
        assert f.fix.startswith("the value read is torch.distributions' argument validation"), f.fix
        assert "validate_args=False" in f.fix and "(not tried)" in f.fix
        bisection = traced.bisection("make_fx")
        assert bisection["culprit"] is None and not [t for t in bisection["trials"] if t["ok"]], bisection
        assert "environment" not in traced.evidence
        assert audit(compiled) == [] and audit(traced) == []
        # A user who turned it off keeps it off.
        Distribution.set_default_validate_args(False)
        _probe("eager,compile:eager")
        assert Distribution._validate_args is False
    finally:
        Distribution.set_default_validate_args(saved)
