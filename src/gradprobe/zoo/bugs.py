"""Known bugs, injectable into the reference potential one switch at a time.

Each bug reproduces a root cause from the catalogue the way it happens in the field. The detectors are
never told which switch is on: ``reference_spec(bug=ID)`` returns an ordinary spec (model factory,
batch, step, the execution paths the "user" trains with), and the diagnosis has to find the cause
from evidence alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ZooBug:
    """One injectable bug: what it does, and how the spec is changed to carry it."""

    id: str
    description: str
    variants: str = "eager"
    model: dict[str, Any] | None = None  # ReferencePotential switches
    eval_model: bool = False  # the factory hands over a model left in eval mode
    mode: str = "terms"  # step contract
    model_family: str = "potential"  # which zoo model carries it: potential | multitask
    checks: tuple[str, ...] = ()  # verification checks whose evidence names it (the demo runs them)
    prefactors: dict[str, float] | None = None  # loss prefactors the user trains with
    optimizer: str | None = None  # "filter": a parameter filter drops a group; "lr0": a group with lr 0
    clip_grad_norm: float | None = None
    conflict: bool = False  # a second energy term with inconsistent reference energies


BUGS: dict[str, ZooBug] = {
    b.id: b
    for b in (
        ZooBug(
            "trace-eval-mode",
            "the model is handed over in eval mode (left there by validation), so forces use "
            "create_graph=self.training=False and come out detached",
            eval_model=True,
        ),
        ZooBug(
            "makefx-detach",
            "the training path traces the step with make_fx (recorded detach nodes kept), then compiles",
            variants="eager,make_fx+compile:aot_eager",
        ),
        ZooBug(
            "double-backward-unsupported",
            "the training path wraps the step, autograd.grad(create_graph=True) included, in torch.compile(aot_eager)",
            variants="eager,compile:aot_eager",
        ),
        ZooBug(
            "backend-drops-grads",
            "a custom dynamo backend with a buggy pass that detaches one weight (fitting.layer2.weight)",
            variants="eager,make_fx[detach=alias]+compile:zoo_lossy",
        ),
        ZooBug(
            "requires-grad-placement",
            "the model differentiates a coordinate leaf it never consumes: it works on a re-created copy",
            model={"recreate_coords": True},
        ),
        ZooBug(
            "graph-break-in-model",
            "a .detach() in the descriptor's embedding net cuts embed1 off every loss term",
            model={"detach_embedding": True},
        ),
        ZooBug(
            "recompile-per-scenario",
            "the multi-task model's weights-mode step turns the loss weights into Python flags "
            "(find_force-style) inside the compiled step",
            variants="eager,compile:aot_eager",
            model_family="multitask",
        ),
        ZooBug(
            "nonfinite-grad",
            "distances by sqrt(r2) on masked neighbour slots, hidden by torch.where: NaN force gradients",
            model={"unsafe_distance": True},
        ),
        ZooBug(
            "norm-mismatch",
            "the user's own trainer path (a registered variant) computes the virial loss without the "
            "per-atom normalisation",
            variants="eager,zoo-trainer",
        ),
        ZooBug(
            "term-dominated",
            "the force prefactor is 1e-6 (energy and virial keep theirs): the other two terms drown it",
            prefactors={"energy": 1.0, "force": 1e-6},
            checks=("balance",),
        ),
        ZooBug(
            "not-in-optimizer",
            "the optimizer is built with a parameter filter that leaves fitting.layer2 out",
            optimizer="filter",
            checks=("balance",),
        ),
        ZooBug(
            "zero-learning-rate",
            "the fitting net's optimizer group has learning rate 0 (a frozen-by-lr fine-tuning setup left on)",
            optimizer="lr0",
            checks=("balance",),
        ),
        ZooBug(
            "clip-swallows-term",
            "gradients are clipped to max_norm 1 while the energy prefactor is 1e4: the energy sets the clip",
            prefactors={"energy": 1e4},
            clip_grad_norm=1.0,
            checks=("balance",),
        ),
        ZooBug(
            "terms-conflict",
            "two energy terms from data sources with inconsistent reference energies (labels 2 eV/atom apart)",
            conflict=True,
            checks=("balance",),
        ),
        ZooBug(
            "ghost-force-slice",
            "forces on periodic images are sliced away instead of scatter-summed onto their local atoms",
            model={"ghost_force": "slice"},
            checks=("physics",),
        ),
    )
}


LOSSY_BACKEND = "zoo_lossy"


def register_lossy_backend() -> None:
    """Register ``zoo_lossy``: aot_eager after a buggy graph pass that detaches ``fitting.layer2.weight``."""
    from torch._dynamo import list_backends, register_backend
    from torch._dynamo.backends.debugging import aot_eager

    if LOSSY_BACKEND in list_backends(exclude_tags=()):
        return

    def zoo_lossy(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        for node in list(gm.graph.nodes):
            if node.op == "placeholder" and "fitting_layer2_weight" in node.name:
                with gm.graph.inserting_after(node):
                    cut = gm.graph.call_function(torch.detach, (node,))
                node.replace_all_uses_with(cut, delete_user_cb=lambda user, cut=cut: user is not cut)
        gm.recompile()
        return aot_eager(gm, example_inputs)

    register_backend(name=LOSSY_BACKEND)(zoo_lossy)


TRAINER_VARIANT = "zoo-trainer"


def register_norm_trainer() -> None:
    """Register ``zoo-trainer``: a trainer with its own loss code, virial not normalised per atom."""
    from ..variants import register_variant
    from .loss import DEFAULT_PREFACTORS, mlip_loss

    def build_trainer(ctx: Any) -> Any:
        model = ctx.model

        def run(batch: Any, weights: Any) -> Any:
            pred = model(batch["coord"], batch["atype"], batch["box"])
            terms = mlip_loss(pred, batch, DEFAULT_PREFACTORS, virial_per_atom=False)  # BUG
            total = sum(weights[name] * value for name, value in terms.items())
            return total, terms

        return run

    register_variant(TRAINER_VARIANT, build_trainer)
