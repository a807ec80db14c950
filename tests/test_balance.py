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


def test_two_derivatives_of_one_energy_conflict_by_construction(zoo_map):
    # Force and virial are both computed from dE/dx inside the step: their gradients pull apart on a
    # healthy potential (cosine about -0.99). That alone is no evidence of harm: info, not a warning.
    fm = zoo_map(None, checks=BALANCE, diagnose=False)
    b = fm.checks["balance"]
    assert b["derivatives"] == ["force", "virial"]
    (f,) = finding(fm, "terms-conflict")
    assert f.location["terms"] == ["force", "virial"] and f.evidence["conflict"]["cosine"] < -0.5
    assert f.severity == "info" and "derivatives of one energy" in f.message
    assert causes(fm, "warning") == [] and causes(fm, "error") == []


def test_a_derivative_conflict_warns_when_training_shows_harm(zoo_map):
    from gradprobe.causes import balance_causes

    fm = zoo_map(None, checks=("balance", "training"), diagnose=False)
    (f,) = [x for x in balance_causes.detect(fm) if x.cause == "terms-conflict"]
    assert f.severity == "info" and "both decrease in the training check" in f.message
    # The same measured conflict, with a training check in which the virial did not decrease:
    fm.checks["training"]["verdicts"]["eager"]["virial"] = "flat"
    (f,) = [x for x in balance_causes.detect(fm) if x.cause == "terms-conflict"]
    assert f.severity == "warning" and "virial flat in eager" in f.message


def test_derivative_terms_seen_on_a_model_written_elsewhere():
    import torch

    from gradprobe.balance import derivative_terms

    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.SiLU(), torch.nn.Linear(8, 1))
    x = torch.randn(6, 2, requires_grad=True)

    def terms():
        y = net(x).sum()
        (dy,) = torch.autograd.grad(y, x, create_graph=True)
        slope = dy.norm(dim=1).mean()  # from a gradient: a derivative term
        return {"value": (y - 1.0) ** 2, "slope": (slope - 2.0) ** 2, "reg": net[0].weight.pow(2).sum()}

    assert derivative_terms(terms, ["value", "slope", "reg"]) == {"slope"}


def test_healthy_demo_is_clean_with_every_check_on(capsys):
    assert main(["demo", "--check", "physics,shapes,training,balance", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("gradprobe: OK: no problem found"), out[:300]
    assert "WARNING" not in out and "ERROR" not in out and "FAIL" not in out
