"""Probe torchmd-net 3.1 (TensorNet) with the generic potential adapter: its own loss, its PyG batch.

    pip install -c constraints.txt 'torchmd-net==3.1.0'
    python examples/torchmdnet_probe.py                        # a tiny random TensorNet; the physics check
    python examples/torchmdnet_probe.py --variants eager,compile_model:aot_eager,compile_model:eager,make_fx
    python examples/torchmdnet_probe.py --scale-forces 0.98    # a fault: forces 2 % off, exit 1

``probe_torchmdnet`` is all the user code: torchmd-net's model takes ``(z, pos, batch, box)`` and returns
``(y, neg_dy)``; its loss is ``mse_loss`` on ``y`` and on ``neg_dy`` (``LNNP._compute_losses``), with
its default weights of 1. Its warp kernels compile on first use (about 25 s, then cached).
"""

from __future__ import annotations

import argparse

import gradprobe
from gradprobe.adapters.potential import PotentialAdapter, with_forces_scaled


def probe_torchmdnet(model, batch, variants="eager", checks=("physics",), diagnose=False):  # type: ignore[no-untyped-def]
    from torch.nn.functional import mse_loss

    adapter = PotentialAdapter(
        model, batch, call=lambda m, b: m(b.z, b.pos, b.batch, box=b.box), energy=0, forces=1,
        loss=lambda out, b: {"energy": mse_loss(out[0], b.y), "force": mse_loss(out[1], b.neg_dy)},
    )  # fmt: skip
    return adapter.probe(variants, checks=checks, diagnose=diagnose)


def tiny_model(seed: int = 0, precision: int = 64):  # type: ignore[no-untyped-def]
    """A small random TensorNet (8 channels, two layers, cutoff 2.5 Å) with forces by autograd."""
    import torch
    from torchmdnet.models.model import create_model

    args = dict(model="tensornet", embedding_dimension=8, num_layers=2, num_rbf=8, rbf_type="expnorm",
                trainable_rbf=False, activation="silu", cutoff_lower=0.0, cutoff_upper=2.5, max_z=10,
                max_num_neighbors=32, equivariance_invariance_group="O(3)", derivative=True,
                output_model="Scalar", prior_model=None, atom_filter=-1, reduce_op="add", precision=precision,
                static_shapes=False, charge=False, spin=False, output_mlp_num_layers=0, box_vecs=None)  # fmt: skip
    torch.manual_seed(seed)
    return create_model(args).train()


def tiny_batch(frames: int = 2, atoms: int = 6, box: float = 5.0, dtype=None):  # type: ignore[no-untyped-def]
    """Random periodic H/O frames (box 5 Å, twice the cutoff, as torchmd-net requires) with random labels."""
    import torch
    from torch_geometric.data import Batch, Data

    dtype = dtype or torch.float64
    data = []
    for seed in range(frames):
        g = torch.Generator().manual_seed(seed)
        data.append(Data(z=torch.tensor([1, 8] * (atoms // 2)), pos=torch.rand(atoms, 3, generator=g, dtype=dtype) * box,
                         box=torch.eye(3, dtype=dtype)[None] * box, y=torch.randn(1, 1, generator=g, dtype=dtype),
                         neg_dy=torch.randn(atoms, 3, generator=g, dtype=dtype)))  # fmt: skip
    return Batch.from_data_list(data)


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

    model, batch = tiny_model(), tiny_batch()
    if args.scale_forces is not None:
        with_forces_scaled(model, args.scale_forces, 1)
    fm = probe_torchmdnet(
        model, batch, args.variants, [c for c in args.checks.split(",") if c], args.diagnose
    )
    print(gradprobe.render(fm))
    return fm.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
