"""A detach that starves one term of a shared trunk: ``gradprobe run examples/stop_gradient.py --diagnose``."""

import torch

import gradprobe


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(3, 4)
        self.head_a = torch.nn.Linear(4, 1)
        self.head_b = torch.nn.Linear(4, 1)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        # the aux head trains on a detached body: meant, or a bug?
        return self.head_a(h), self.head_b(h.detach())


def step(model, batch):
    a, b = model(batch)
    return {"main": a.pow(2).mean(), "aux": b.pow(2).mean()}


def spec():
    torch.manual_seed(0)
    return gradprobe.ProbeSpec(model=TwoHeads(), step=step, batch=torch.randn(8, 3))
