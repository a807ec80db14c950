"""expect=: what a scenario must (not) reach, declared in the spec, flagged with where the gradient stops.

The model is written unlike the zoo (a functional two-tower with a shared stem, the cut in a helper).
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

import gradprobe
from gradprobe.cli import main
from gradprobe.errors import SpecError
from gradprobe.flowmap import FlowMap
from gradprobe.testing import grad_flow_problems


class Towers(torch.nn.Module):
    def __init__(self, cut: bool) -> None:
        super().__init__()
        self.cut = cut
        self.stem = torch.nn.Linear(4, 6)
        self.left = torch.nn.Linear(6, 1)
        self.right = torch.nn.Linear(6, 1)

    def shared(self, x):
        h = torch.relu(self.stem(x))
        return h.detach() if self.cut else h  # the break: the right tower's term loses the stem

    def forward(self, x):
        return self.left(torch.relu(self.stem(x))), self.right(self.shared(x))


def step(model, x):
    a, b = model(x)
    return {"left": a.square().mean(), "right": (b - 1).abs().mean()}


def spec(cut: bool, **fields):
    torch.manual_seed(0)
    return gradprobe.ProbeSpec(model=Towers(cut), step=step, batch=torch.randn(16, 4), **fields)


EXPECT = {"right only": ["stem", "right"]}


def test_a_declared_reach_that_breaks_is_an_error_with_the_place_it_stops():
    fm = gradprobe.probe(spec(True, expect=EXPECT), diagnose=True, progress=False)
    (f,) = [f for f in fm.findings if f.cause == "expectation-unmet"]
    assert f.severity == "error" and fm.exit_code == 1
    assert f.evidence["parameters"] == ["stem.weight", "stem.bias"]
    assert f.location["file"].endswith("test_expect.py") and "h.detach()" in f.location["code"]
    assert "the gradient stops at test_expect.py:" in f.message
    assert "remove the cut at test_expect.py:" in f.fix


def test_without_diagnose_the_finding_says_how_to_locate_it():
    fm = gradprobe.probe(spec(True, expect=EXPECT), progress=False)
    (f,) = [f for f in fm.findings if f.cause == "expectation-unmet"]
    assert "run with --diagnose to locate it" in f.fix and "file" not in f.location


def test_a_met_declaration_is_silent_and_the_map_keeps_it(tmp_path):
    fm = gradprobe.probe(spec(False, expect={"right only": {"reaches": ["stem"], "not_reaches": ["left"]}}))
    assert not [f for f in fm.findings if f.cause == "expectation-unmet"] and fm.exit_code == 0
    fm.to_json(tmp_path / "m.json")
    back = FlowMap.from_json(tmp_path / "m.json")
    assert back.expect == {"right only": {"reaches": ["stem"], "not_reaches": ["left"]}} and back == fm


def test_not_reaches_is_checked_too():
    fm = gradprobe.probe(spec(False, expect={"right only": {"not_reaches": ["stem."]}}), progress=False)
    (f,) = [f for f in fm.findings if f.cause == "expectation-unmet"]
    assert f.evidence["kind"] == "not_reaches" and f.evidence["parameters"] == ["stem.bias", "stem.weight"]


@pytest.mark.parametrize(
    ("expect", "said"),
    [
        ({"rihgt only": ["stem"]}, "did you mean 'right only'"),
        ({"right only": ["stme"]}, "matches no trainable parameter"),
        ({"right only": "stem"}, "must be a list of parameter prefixes"),
        ({"right only": {"reach": ["stem"]}}, "its keys are 'reaches' and 'not_reaches'"),
        (["stem"], "expect must be a mapping"),
    ],
)
def test_a_wrong_declaration_is_refused_with_the_fix(expect, said):
    with pytest.raises(SpecError, match=said):
        gradprobe.probe(spec(False, expect=expect, terms=["left", "right"]), progress=False)


def test_assert_grad_flow_reads_the_same_declarations():
    fm = gradprobe.probe(spec(True), progress=False)
    assert grad_flow_problems(fm, reaches=EXPECT) == [
        "right only in eager: expected to reach stem.weight, stem.bias, but it does not"
    ]
    assert "which the flow map does not have" in grad_flow_problems(fm, reaches={"nope": ["stem"]})[0]


def test_cli_expect_with_diagnose_names_the_line(tmp_path, capsys):
    target = tmp_path / "towers_spec.py"
    target.write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(__file__.rsplit("/", 1)[0])!r})
        from test_expect import spec as make


        def spec():
            return make(True)
    """)
    )
    code = main(["run", str(target), "--expect", "right only=stem", "--diagnose", "--quiet", "--json",
                 str(tmp_path / "m.json")])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1
    assert "ERROR expectation-unmet: right only in eager: declared to reach 'stem'" in out
    assert "the gradient stops at test_expect.py:" in out
    saved = json.loads((tmp_path / "m.json").read_text())
    assert saved["expect"] == {"right only": {"reaches": ["stem"], "not_reaches": []}}
    assert main(["run", str(target), "--expect", "right only", "--quiet"]) == 2
    assert "write SCENARIO=PREFIX" in capsys.readouterr().err


def test_a_declaration_broken_only_inside_an_opaque_user_path_is_named_there():
    from gradprobe.variants import user_variant

    def my_trainer(ctx):  # a plain callable: no graph, no counter, no knobs
        model = ctx.model

        def run(x, weights):
            a = model.left(torch.relu(model.stem(x)))
            b = model.right(torch.relu(model.stem(x)).detach())  # the break, in the user's path only
            return weights["left"] * a.square().mean() + weights["right"] * (b - 1).abs().mean()

        return run

    fm = gradprobe.probe(
        spec(False, expect=EXPECT, terms=["left", "right"]),
        variants=["eager", user_variant("my_trainer", my_trainer)], diagnose=True, progress=False,
    )  # fmt: skip
    (f,) = [f for f in fm.findings if f.cause == "expectation-unmet"]
    assert f.evidence["variant"] == "my_trainer" and f.evidence["parameters"] == ["stem.weight", "stem.bias"]
    assert "detach()" in f.location["code"] and f.location["file"].endswith("test_expect.py")
