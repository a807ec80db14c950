"""The eager probe on the reference potential: counts against hand-derived and independent answers."""

import dataclasses

import pytest
import torch

import gradprobe
from gradprobe.zoo import ReferencePotential, make_batch, mlip_loss

ALL_PARAMS = {
    "energy_shift", "type_embedding.weight",
    "descriptor.embed1.weight", "descriptor.embed1.bias", "descriptor.embed2.weight", "descriptor.embed2.bias",
    "fitting.layer1.weight", "fitting.layer1.bias", "fitting.layer2.weight", "fitting.layer2.bias",
    "fitting.out.weight", "fitting.out.bias", "aux_head.weight", "aux_head.bias",
}  # fmt: skip
AUX = {"aux_head.weight", "aux_head.bias"}
# Hand-derived: the auxiliary head feeds no loss term; a constant per-atom energy (the per-type
# shift, the output bias) moves the energy but no force or virial.
EXPECTED = {
    "energy only": ALL_PARAMS - AUX,
    "force only": ALL_PARAMS - AUX - {"energy_shift", "fitting.out.bias"},
    "virial only": ALL_PARAMS - AUX - {"energy_shift", "fitting.out.bias"},
    "all": ALL_PARAMS - AUX,
}


@pytest.fixture(scope="module")
def ref_map():
    return gradprobe.probe(gradprobe.zoo.reference_spec())


def test_hand_derived_expectations(ref_map):
    assert set(ref_map.trainable) == ALL_PARAMS
    assert ref_map.scenario_names == tuple(EXPECTED)
    for scenario, expected in EXPECTED.items():
        assert ref_map.reached("eager", scenario) == expected, scenario
        assert ref_map.count("eager", scenario) == (len(expected), 14)
    # The energy shift: energy gradient yes, force/virial no. Force isolated by differentiating
    # the term alone, so the unreached show `none`, not `zero`.
    assert ref_map.cell("eager", "energy only", "energy_shift").status == "nonzero"
    assert ref_map.cell("eager", "force only", "energy_shift").status == "none"
    assert ref_map.cell("eager", "virial only", "fitting.out.bias").status == "none"
    for scenario in EXPECTED:
        assert ref_map.cell("eager", scenario, "aux_head.weight").status == "none"


def test_matches_independent_per_term_autograd(ref_map):
    # Independent computation: a fresh forward and plain autograd.grad per term.
    spec = gradprobe.zoo.reference_spec()
    model = spec.model()
    batch = spec.batch
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    per_term = {}
    for term in ("energy", "force", "virial"):
        terms = mlip_loss(model(batch["coord"], batch["atype"], batch["box"]), batch)
        grads = torch.autograd.grad(terms[term], params, allow_unused=True)
        per_term[term] = {n for n, g in zip(names, grads, strict=True) if g is not None and g.abs().sum() > 0}
        # Norms agree too (L1).
        for n, g in zip(names, grads, strict=True):
            cell = ref_map.cell("eager", f"{term} only", n)
            if g is None:
                assert cell.status == "none" and cell.norm is None
            else:
                assert cell.norm == pytest.approx(g.abs().sum().item(), rel=1e-12)
    for term, reached in per_term.items():
        assert ref_map.reached("eager", f"{term} only") == reached
    assert ref_map.reached("eager", "all") == set().union(*per_term.values())


def test_terms_and_weights_mode_agree():
    terms_map = gradprobe.probe(gradprobe.zoo.reference_spec(mode="terms"))
    weights_map = gradprobe.probe(gradprobe.zoo.reference_spec(mode="weights"))
    assert weights_map.mode == "weights" and terms_map.mode == "terms"
    for s in terms_map.scenario_names:
        assert terms_map.reached("eager", s) == weights_map.reached("eager", s), s
    # Weights mode multiplies switched-off terms by 0: unreached parameters read `zero` or `none`
    # depending on the path, never `nonzero`.
    assert weights_map.cell("eager", "force only", "energy_shift").status in ("zero", "none")
    # The same term values were seen.
    for s in terms_map.scenario_names:
        tv, wv = terms_map.run("eager", s).term_values, weights_map.run("eager", s).term_values
        assert tv.keys() == wv.keys()
        for k in tv:
            assert tv[k] == pytest.approx(wv[k], rel=1e-12)


def test_without_virial_labels():
    fm = gradprobe.probe(gradprobe.zoo.reference_spec(with_virial=False))
    assert fm.terms == ("energy", "force")
    assert fm.scenario_names == ("energy only", "force only", "all")


def test_user_scenarios_and_undeclared_terms():
    spec = dataclasses.replace(
        gradprobe.zoo.reference_spec(), terms=None, scenarios={"forces+virial": ["force", "virial"]}
    )
    fm = gradprobe.probe(spec)
    assert fm.terms == ("energy", "force", "virial")  # taken from the step's output
    assert fm.scenario_names == ("forces+virial",)
    assert fm.reached("eager", "forces+virial") == EXPECTED["force only"]


def test_unused_head_is_an_info_finding(ref_map):
    assert ref_map.exit_code == 0
    (finding,) = ref_map.findings
    assert finding.cause == "unused-parameter" and finding.severity == "info"
    assert set(finding.evidence["parameters"]) == AUX
    assert "auxiliary head" in finding.message


def test_eval_mode_model_is_a_recorded_symptom():
    # create_graph=self.training: in eval mode forces are detached, so the force and virial terms
    # have no gradient path. That is data in the map, not a crash.
    spec = gradprobe.zoo.reference_spec()
    model = spec.model().eval()
    fm = gradprobe.probe(dataclasses.replace(spec, model=model))
    for s in ("force only", "virial only"):
        err = fm.run("eager", s).error
        assert err is not None and err.type == "NoGradPath" and err.stage == "backward"
        # What was measured (no grad_fn), not a guessed cause (it used to ask "eval mode?").
        assert "no grad_fn" in err.message and "eval mode" not in err.message
    # The force's autograd.grad without create_graph also freed the energy graph: the energy
    # term (and so "all") fails at backward instead of crashing the probe.
    for s in ("energy only", "all"):
        err = fm.run("eager", s).error
        assert err is not None and err.stage == "backward" and "second time" in err.message
    assert fm.cells_of("eager", "all") == {}
    assert fm.exit_code == 1
    assert any(f.cause == "run-failed" and f.severity == "error" for f in fm.findings)
    assert not model.training  # left as found


def test_backward_through_graph_twice_is_recorded_in_weights_mode():
    # In eval mode the force autograd.grad frees the energy graph; the weights-mode total then
    # fails at backward with "Trying to backward through the graph a second time".
    spec = gradprobe.zoo.reference_spec(mode="weights")
    fm = gradprobe.probe(dataclasses.replace(spec, model=spec.model().eval()))
    err = fm.run("eager", "energy only").error
    assert err is not None and err.stage == "backward"
    assert "second time" in err.message
    assert fm.exit_code == 1


def test_real_model_float32_device_agnostic_dtype():
    spec = gradprobe.zoo.reference_spec(dtype=torch.float32)
    fm = gradprobe.probe(spec)
    assert fm.dtype == "float32" and fm.device == "cpu"
    assert fm.reached("eager", "force only") == EXPECTED["force only"]


def test_reference_model_is_real():
    model = ReferencePotential().double()
    batch = make_batch()
    out = model(batch["coord"], batch["atype"], batch["box"])
    assert out["force"].shape == batch["force"].shape and out["force"].grad_fn is not None
