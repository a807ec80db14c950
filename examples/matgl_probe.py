"""Probe matgl 4.1 (TensorNet in ``Potential``) with the generic potential adapter: matgl's own loss,
its PyG batch as its loader collates it.

    pip install -c constraints.txt 'matgl==4.1.2'
    python examples/matgl_probe.py                             # a tiny random TensorNet; the physics check
    python examples/matgl_probe.py --variants eager,compile_model:aot_eager,make_fx
    python examples/matgl_probe.py --scale-forces 0.98         # a fault: forces 2 % off, exit 1

``probe_matgl`` is all the user code: matgl's batch is the tuple its ``collate_fn_pes`` makes, ``(g, lat,
state_attr, energies, forces, stresses)`` with fractional coordinates in ``g.frac_coords``; its
``Potential`` returns ``(energies, forces, stresses in GPa, hessian)``; its
``PotentialLightningModule.loss_fn`` returns only the total loss, which the adapter splits into energy,
force and stress terms (each output in turn replaced by its label: its part of the loss vanishes).
TensorNet keeps its intermediate features in ``model.feature_dict``, refilled on every call.
"""

from __future__ import annotations

import argparse

import gradprobe
from gradprobe.adapters.potential import EV_PER_A3_IN_GPA, PotentialAdapter, Stress, with_forces_scaled


def probe_matgl(lit, batch, variants="eager", checks=("physics",), diagnose=False):  # type: ignore[no-untyped-def]
    adapter = PotentialAdapter(
        lit.model, batch, call=lambda m, b: m(*b[:3]), energy=0, forces=1,
        stress=Stress(2, scale=1 / EV_PER_A3_IN_GPA), positions="0.frac_coords", fractional=True, cell=1,
        labels={"energy": 3, "force": 4, "stress": 5},
        loss=lambda out, b: lit.loss_fn(lit.loss, b[3:], out[:3], b[0].ptr.diff())["Total_Loss"],
    )  # fmt: skip
    return adapter.probe(variants, checks=checks, diagnose=diagnose)


def tiny_module(seed: int = 0):  # type: ignore[no-untyped-def]
    """matgl's ``PotentialLightningModule`` around a small random TensorNet (8 units, two blocks, cutoff
    3 Å), stress weight 0.1: the module holds matgl's ``Potential`` (``.model``) and its loss."""
    import torch
    from matgl.models import TensorNet
    from matgl.utils.training import PotentialLightningModule

    torch.manual_seed(seed)
    net = TensorNet(element_types=("H", "O"), units=8, nblocks=2, num_rbf=8, cutoff=3.0, is_intensive=False)
    lit = PotentialLightningModule(model=net, stress_weight=0.1)
    lit.model.train()
    return lit


def tiny_batch(frames: int = 2):  # type: ignore[no-untyped-def]
    """Two rattled 8-atom H/O frames with random labels, through matgl's ``Atoms2Graph`` and its own
    ``collate_fn_pes``, as its data loader gives them."""
    import ase.build
    import matgl
    import numpy as np
    import torch
    from matgl.ext.ase import Atoms2Graph
    from matgl.graph.data import collate_fn_pes

    convert = Atoms2Graph(element_types=("H", "O"), cutoff=3.0)
    items = []
    for seed in range(frames):
        atoms = ase.build.bulk("H", "sc", a=1.6, cubic=True) * (2, 2, 2)
        atoms.symbols[::2] = "O"
        atoms.rattle(0.05, seed=seed)
        g, lat, state = convert.get_graph(atoms)
        g.frac_coords = torch.as_tensor(atoms.get_scaled_positions(), dtype=matgl.float_th)
        rng = np.random.RandomState(seed)
        labels = {"energies": float(rng.randn()), "forces": torch.as_tensor(rng.randn(len(atoms), 3), dtype=matgl.float_th),
                  "stresses": torch.as_tensor(rng.randn(3, 3), dtype=matgl.float_th)}  # fmt: skip
        items.append((g, torch.as_tensor(np.asarray(lat), dtype=matgl.float_th).reshape(1, 3, 3),
                      torch.as_tensor(state), labels))  # fmt: skip
    return collate_fn_pes(items)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="eager")
    parser.add_argument("--checks", default="physics")
    parser.add_argument(
        "--diagnose", action="store_true", help="lineage, bisection and the line of each cause"
    )
    parser.add_argument(
        "--scale-forces", type=float, default=None, help="a fault: the model's forces times this"
    )
    args = parser.parse_args(argv)

    lit, batch = tiny_module(), tiny_batch()
    if args.scale_forces is not None:
        with_forces_scaled(lit.model, args.scale_forces, 1)
    fm = probe_matgl(lit, batch, args.variants, [c for c in args.checks.split(",") if c], args.diagnose)
    print(gradprobe.render(fm))
    return fm.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
