"""Probe SevenNet 0.13 with the generic potential adapter: its own loss terms, its own graph batch.

    pip install -c constraints.txt 'sevenn==0.13.0'
    python examples/sevennet_probe.py                          # a tiny random model; the physics check
    python examples/sevennet_probe.py --pretrained             # SevenNet-0 (ships in sevenn's wheel)
    python examples/sevennet_probe.py --variants eager,compile_model:aot_eager,make_fx
    python examples/sevennet_probe.py --scale-forces 0.98      # a fault: forces 2 % off, exit 1

``probe_sevennet`` is all the user code (the model, the batch and SevenNet's loss are what a SevenNet
user already has): SevenNet's outputs by key, its stress (minus the ASE stress, Voigt ``xx yy zz xy yz
zx``), and the edge vectors SevenNet computes with the batch, rebuilt when the physics check moves an
atom. SevenNet casts to float32 inside its embedding, so the physics check runs in float32 and says
which force error it can detect.
"""

from __future__ import annotations

import argparse

import gradprobe
from gradprobe.adapters.potential import PotentialAdapter, Stress, with_forces_scaled
from gradprobe.geometry import edge_vectors

TERMS = ("energy", "force", "stress")


def probe_sevennet(model, batch, loss_functions, variants="eager", checks=("physics",), diagnose=False):  # type: ignore[no-untyped-def]
    adapter = PotentialAdapter(
        model, batch, energy="inferred_total_energy", forces="inferred_force", cell="cell_lattice_vectors",
        stress=Stress("inferred_stress", scale=-1, order="xx yy zz xy yz zx"),
        rebuild=edge_vectors("edge_vec", shift="pbc_shift"),
        loss=lambda out, b: {t: w * f.get_loss(out) for t, (f, w) in zip(TERMS, loss_functions, strict=True)},
    )  # fmt: skip
    return adapter.probe(variants, checks=checks, diagnose=diagnose)


def tiny_model(seed: int = 0):  # type: ignore[no-untyped-def]
    """A small random SevenNet (two interaction layers, 4 channels, l_max 1) for H and O."""
    import torch
    from sevenn import _keys
    from sevenn._const import DEFAULT_E3_EQUIVARIANT_MODEL_CONFIG
    from sevenn.model_build import build_E3_equivariant_model
    from sevenn.util import chemical_species_preprocess

    config = {**DEFAULT_E3_EQUIVARIANT_MODEL_CONFIG, **chemical_species_preprocess(["H", "O"])}
    config.update({_keys.CUTOFF: 3.0, _keys.NODE_FEATURE_MULTIPLICITY: 4, _keys.NUM_CONVOLUTION: 2, _keys.LMAX: 1,
                   _keys.CONVOLUTION_WEIGHT_NN_HIDDEN_NEURONS: [8], _keys.IS_PARITY: False,
                   _keys.CONV_DENOMINATOR: 4.0, _keys.SHIFT: 0.0, _keys.SCALE: 1.0})  # fmt: skip
    torch.manual_seed(seed)
    return build_E3_equivariant_model(config).train()


def pretrained():  # type: ignore[no-untyped-def]
    """SevenNet-0 (11Jul2024), from the checkpoint in sevenn's wheel: no download."""
    from sevenn.util import model_from_checkpoint, pretrained_name_to_path

    model, _ = model_from_checkpoint(pretrained_name_to_path("7net-0"))
    return model.train()


def tiny_batch(cutoff: float, frames: int = 2):  # type: ignore[no-untyped-def]
    """Two rattled 8-atom H/O frames with random labels, through SevenNet's own graph builder."""
    import ase.build
    import numpy as np
    from ase.calculators.singlepoint import SinglePointCalculator
    from sevenn.atom_graph_data import AtomGraphData
    from sevenn.train.dataload import atoms_to_graph
    from torch_geometric.data import Batch

    graphs = []
    for seed in range(frames):
        atoms = ase.build.bulk("H", "sc", a=1.6, cubic=True) * (2, 2, 2)
        atoms.symbols[::2] = "O"
        atoms.rattle(0.05, seed=seed)
        rng = np.random.RandomState(seed)
        atoms.calc = SinglePointCalculator(atoms, energy=float(rng.randn()), forces=rng.randn(len(atoms), 3),
                                           stress=0.01 * rng.randn(6))  # fmt: skip
        graphs.append(
            AtomGraphData.from_numpy_dict(atoms_to_graph(atoms, cutoff, y_from_calc=True, with_shift=True))
        )
    return Batch.from_data_list(graphs)


def loss_functions():  # type: ignore[no-untyped-def]
    """SevenNet's own loss terms with its default training prefactors (MSE; force 0.1, stress 1e-6)."""
    from sevenn._const import DEFAULT_TRAINING_CONFIG
    from sevenn.train.loss import get_loss_functions_from_config

    return get_loss_functions_from_config(dict(DEFAULT_TRAINING_CONFIG))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="eager")
    parser.add_argument("--checks", default="physics")
    parser.add_argument(
        "--diagnose", action="store_true", help="lineage, bisection and the line of each cause"
    )
    parser.add_argument("--pretrained", action="store_true", help="SevenNet-0 instead of a tiny random model")
    parser.add_argument(
        "--scale-forces", type=float, default=None, help="a fault: the model's forces times this"
    )
    args = parser.parse_args(argv)

    model = pretrained() if args.pretrained else tiny_model()
    batch = tiny_batch(5.0 if args.pretrained else 3.0)
    if args.scale_forces is not None:
        with_forces_scaled(model, args.scale_forces, "inferred_force")
    fm = probe_sevennet(
        model, batch, loss_functions(), args.variants, [c for c in args.checks.split(",") if c]
    )
    print(gradprobe.render(fm))
    return fm.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
