"""Beyond reachability: each reason a reached term stays flat is named, detector not told which switch."""

import pytest

from gradprobe.cli import main

BALANCE = ("balance",)


def causes(fm, severity=None):
    return sorted(f.cause for f in fm.findings if severity is None or f.severity == severity)


def finding(fm, cause):
    return [f for f in fm.findings if f.cause == cause]


def test_clean_potential_has_no_balance_error(zoo_map):
    fm = zoo_map(None, checks=BALANCE, diagnose=False)
    assert causes(fm, "error") == []
    b = fm.checks["balance"]
    assert b["dominated"] == []
    assert all(b["shares"]["virial"][g] > 0.01 for g in ("descriptor", "fitting"))
    assert b["optimizer"] == {"optimizer": "Adam", "not_in_optimizer": {}, "zero_lr": {}}


def test_term_dominated_names_the_term_the_dominator_and_the_prefactor(zoo_map):
    fm = zoo_map("term-dominated", checks=BALANCE, diagnose=False)
    (f,) = finding(fm, "term-dominated")
    assert f.location["term"] == "force" and f.evidence["dominated"]["by"] in ("energy", "virial")
    assert f.evidence["dominated"]["prefactor_factor"] > 1e3
    assert causes(fm, "error") == []


def test_missing_group_in_optimizer(zoo_map):
    fm = zoo_map("not-in-optimizer", checks=BALANCE, diagnose=False)
    assert causes(fm, "error") == ["not-in-optimizer"]
    assert finding(fm, "not-in-optimizer")[0].evidence["parameters"] == [
        "fitting.layer2.weight",
        "fitting.layer2.bias",
    ]


def test_zero_learning_rate_group(zoo_map):
    fm = zoo_map("zero-learning-rate", checks=BALANCE, diagnose=False)
    assert causes(fm, "error") == ["zero-learning-rate"]
    assert all(p.startswith("fitting.") for p in finding(fm, "zero-learning-rate")[0].evidence["parameters"])


def test_clipping_that_swallows_terms(zoo_map):
    fm = zoo_map("clip-swallows-term", checks=BALANCE, diagnose=False)
    assert causes(fm, "error") == ["clip-swallows-term", "clip-swallows-term"]
    swallowed = {f.evidence["term"] for f in finding(fm, "clip-swallows-term")}
    assert swallowed == {"force", "virial"}
    assert fm.checks["balance"]["clipping"]["terms"]["energy"]["relative_update"] == pytest.approx(
        1.0, rel=1e-2
    )


def test_conflicting_terms(zoo_map):
    fm = zoo_map("terms-conflict", checks=BALANCE, diagnose=False)
    pairs = [f.location["terms"] for f in finding(fm, "terms-conflict")]
    assert ["energy", "energy_b"] in pairs
    conflict = next(f for f in finding(fm, "terms-conflict") if f.location["terms"] == ["energy", "energy_b"])
    assert conflict.evidence["conflict"]["cosine"] < -0.99
    assert causes(fm, "error") == []


def test_frozen_parameters_a_term_needs():
    import torch

    import gradprobe

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    model[0].requires_grad_(False)
    fm = gradprobe.probe(model, lambda m, b: {"fit": m(b).pow(2).mean(), "reg": m[2].weight.pow(2).sum()},
                         torch.randn(5, 3), checks=["balance"])  # fmt: skip
    (f,) = finding(fm, "frozen-but-needed")
    assert f.evidence == {"term": "fit", "parameters": ["0.weight", "0.bias"]}
    assert not model[0].weight.requires_grad  # restored


def test_demo_shows_shares_and_suggested_prefactor(capsys):
    assert main(["demo", "--bug", "term-dominated"]) == 0  # warnings do not fail the run
    out = capsys.readouterr().out
    assert (
        "WARNING term-dominated: term force is drowned" in out
        and "multiply the force prefactor by about" in out
    )
    assert "balance: share of each group's gradient norm, by term" in out
