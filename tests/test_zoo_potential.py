"""The reference potential is a real, correct MLIP (float64 physics checks), and its bugs are real."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from gradprobe.zoo.data import MIN_DISTANCE, make_batch, teacher_energy, teacher_labels
from gradprobe.zoo.loss import Prefactors, mlip_loss
from gradprobe.zoo.potential import ReferencePotential, extend_coord

H = 1e-5
# (frame, atom, direction) triples for the finite-difference checks
PROBES = [(0, 0, 0), (0, 3, 1), (1, 5, 2), (1, 7, 0), (0, 6, 2)]
AUX = {"aux_head.weight", "aux_head.bias"}
NO_FORCE_GRAD = AUX | {"energy_shift", "fitting.out.bias"}


def _model(ghost_force: str = "scatter") -> ReferencePotential:
    torch.manual_seed(0)
    return ReferencePotential(ghost_force=ghost_force).double()


@pytest.fixture(scope="module")
def batch() -> dict[str, torch.Tensor]:
    return make_batch()


def _fd_forces(energy_fn, coord, atype, box) -> torch.Tensor:
    """Minus central finite differences of energy_fn w.r.t. coord, at PROBES."""
    out = []
    for f, i, d in PROBES:
        plus, minus = coord.clone(), coord.clone()
        plus[f, i, d] += H
        minus[f, i, d] -= H
        out.append(-(energy_fn(plus, atype, box)[f] - energy_fn(minus, atype, box)[f]) / (2 * H))
    return torch.stack(out)


def _fd_virial(energy_fn, coord, atype, box) -> torch.Tensor:
    """-dE/d(strain) by central differences, straining coord and box together."""
    nf = coord.shape[0]
    vir = torch.zeros(nf, 3, 3, dtype=coord.dtype)
    for a in range(3):
        for b in range(3):
            eps = torch.zeros(3, 3, dtype=coord.dtype)
            eps[a, b] = H
            e_p = energy_fn(coord @ (torch.eye(3) + eps), atype, box @ (torch.eye(3) + eps))
            e_m = energy_fn(coord @ (torch.eye(3) - eps), atype, box @ (torch.eye(3) - eps))
            vir[:, a, b] = -(e_p - e_m) / (2 * H)
    return vir


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


def _at_probes(force: torch.Tensor) -> torch.Tensor:
    return torch.stack([force[f, i, d] for f, i, d in PROBES])


def _inputs(batch):
    return batch["coord"], batch["atype"], batch["box"]


def test_forces_are_minus_energy_gradient(batch):
    model = _model()
    with torch.no_grad():
        fd = _fd_forces(model.energy, *_inputs(batch))
    force = model(*_inputs(batch))["force"]
    assert _rel(_at_probes(force), fd) < 1e-7
    assert force.sum(1).abs().max() < 1e-10  # translation invariance: no net force


def test_slice_ghost_force_bug_is_wrong(batch):
    model = _model("slice")
    with torch.no_grad():
        fd = _fd_forces(model.energy, *_inputs(batch))
    force = model(*_inputs(batch))["force"]
    assert _rel(_at_probes(force), fd) > 1e-2
    assert force.sum(1).abs().max() > 1e-2 * force.abs().mean()  # net force: not translation invariant


def test_virial_symmetric_and_strain_derivative(batch):
    model = _model()
    virial = model(*_inputs(batch))["virial"].detach()
    assert (virial - virial.transpose(1, 2)).abs().max() < 1e-10
    with torch.no_grad():
        fd = _fd_virial(model.energy, *_inputs(batch))
    assert _rel(virial, fd) < 1e-6


def test_energy_rotation_and_translation_invariant(batch):
    model = _model()
    coord, atype, box = _inputs(batch)
    rot, _ = torch.linalg.qr(torch.tensor([[0.3, -1.2, 0.5], [0.9, 0.1, -0.4], [0.2, 0.7, 1.1]]).double())
    with torch.no_grad():
        e0 = model.energy(coord, atype, box)
        e_rot = model.energy(coord @ rot.T, atype, box @ rot.T)
        e_shift = model.energy(coord + torch.tensor([0.7, -2.3, 4.1]).double(), atype, box)
    torch.testing.assert_close(e_rot, e0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(e_shift, e0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model(coord, atype, box)["energy"].detach(), e0, rtol=1e-14, atol=1e-14)


def test_eval_mode_forces_are_detached(batch):
    model = _model()
    assert model(*_inputs(batch))["force"].grad_fn is not None
    model.eval()
    out = model(*_inputs(batch))
    assert out["force"].grad_fn is None and not out["force"].requires_grad
    assert out["energy"].requires_grad  # the energy itself still is attached


def test_teacher_labels(batch):
    coord, atype, box = _inputs(batch)
    assert set(batch) == {"coord", "atype", "box", "energy", "force", "virial"}
    assert batch["coord"].shape == (2, 8, 3) and batch["force"].shape == (2, 8, 3)
    assert batch["atype"].dtype == torch.long and batch["box"].shape == (2, 3, 3)
    assert batch["energy"].shape == (2,) and batch["virial"].shape == (2, 3, 3)
    assert set(atype.unique().tolist()) == {0, 1}
    with torch.no_grad():
        fd = _fd_forces(teacher_energy, coord, atype, box)
        fd_vir = _fd_virial(teacher_energy, coord, atype, box)
    assert _rel(_at_probes(batch["force"]), fd) < 1e-7
    assert _rel(batch["virial"], fd_vir) < 1e-6
    torch.testing.assert_close(teacher_labels(coord, atype, box)["energy"], batch["energy"])
    # every periodic pair (images included) respects the minimum distance of the generator
    ext, _ = extend_coord(coord, box)
    dist = (ext[:, None] - ext[:, :8, None]).norm(dim=-1) + torch.eye(8, ext.shape[1]) * 1e9
    assert dist.min() >= MIN_DISTANCE


def test_make_batch_deterministic_and_shapes():
    state = torch.get_rng_state()
    a, b = make_batch(seed=3), make_batch(seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    for k in a:
        assert torch.equal(a[k], b[k])
    other = make_batch(seed=4)
    assert {k: v.shape for k, v in other.items()} == {k: v.shape for k, v in a.items()}
    assert not torch.equal(other["coord"], a["coord"])
    small = make_batch(nframes=3, natoms=5, dtype=torch.float32, with_virial=False)
    assert "virial" not in small and small["coord"].shape == (3, 5, 3)
    assert small["coord"].dtype == torch.float32 and small["atype"].dtype == torch.long


def test_loss_term_gradient_pattern(batch):
    model = _model()
    names, params = zip(*model.named_parameters(), strict=True)
    terms = mlip_loss(model(*_inputs(batch)), batch, Prefactors())
    assert list(terms) == ["energy", "force", "virial"]
    for term, value in terms.items():
        grads = torch.autograd.grad(value, params, allow_unused=True, retain_graph=True)
        missing = AUX if term == "energy" else NO_FORCE_GRAD
        for name, g in zip(names, grads, strict=True):
            if name in missing:
                assert g is None, f"{term} should not reach {name}"
            else:
                assert g is not None and g.abs().sum() > 0, f"{term} should reach {name}"


def test_loss_without_virial(batch):
    model = _model()
    no_vir = {k: v for k, v in batch.items() if k != "virial"}
    terms = mlip_loss(model(*_inputs(batch)), no_vir, Prefactors(energy=2.0))
    assert list(terms) == ["energy", "force"]
    per_atom = (model.energy(*_inputs(batch)) - batch["energy"]) / 8
    torch.testing.assert_close(terms["energy"], 2.0 * (per_atom**2).mean())


def test_make_fx_trace_matches_eager(batch):
    model = _model()
    assert model.count_max_neighbours(*_inputs(batch)) < model.sel
    traced = make_fx(lambda c, a, b: model(c, a, b)["force"])(*_inputs(batch))
    torch.testing.assert_close(traced(*_inputs(batch)), model(*_inputs(batch))["force"])
