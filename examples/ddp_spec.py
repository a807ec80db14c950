"""A DDP model whose second head only rank 1 uses: ``gradprobe run examples/ddp_spec.py --nproc 2``.

Rank 1's batch asks for the second head, rank 0's does not: DDP without ``find_unused_parameters=True``
would stop at "Expected to have finished reduction in the prior iteration" (docs/distributed.md).
"""

import torch
from torch.nn.parallel import DistributedDataParallel

import gradprobe


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(3, 4)
        self.head_a = torch.nn.Linear(4, 1)
        self.head_b = torch.nn.Linear(4, 1)

    def forward(self, x, use_b):
        h = torch.tanh(self.body(x))
        return self.head_a(h) + (self.head_b(h) if use_b else 0.0)


def step(model, batch):
    pred = model(batch["x"], batch["use_b"])
    return {"fit": (pred - batch["y"]).pow(2).mean(), "smooth": pred.pow(2).mean()}


def spec(rank=0, world_size=1):
    torch.manual_seed(0)  # the same initial values on every rank
    model = DistributedDataParallel(TwoHeads().double())
    g = torch.Generator().manual_seed(rank)  # each rank its own batch
    x = torch.randn(5, 3, generator=g, dtype=torch.float64)
    y = torch.randn(5, 1, generator=g, dtype=torch.float64)
    return gradprobe.ProbeSpec(model=model, step=step, batch={"x": x, "y": y, "use_b": rank == 1})
