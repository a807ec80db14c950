"""The NequIP adapter's backend knob without NequIP installed: NequIP calls ``torch.compile`` without a
backend, and the adapter's ``compile_backend`` gives that call the chosen one, then restores
``torch.compile``."""

from __future__ import annotations

import torch

from gradprobe.adapters.nequip import compile_backend, term_of


def test_compile_backend_sets_the_backend_of_calls_that_name_none() -> None:
    seen: list[int] = []

    def counting(gm, example_inputs):  # type: ignore[no-untyped-def]
        seen.append(len(gm.graph.nodes))
        return gm.forward

    original = torch.compile
    with compile_backend(counting):  # type: ignore[arg-type]
        f = torch.compile(lambda x: x * 2 + 1)
    assert torch.compile is original
    torch._dynamo.reset()
    assert torch.equal(f(torch.ones(3)), torch.full((3,), 3.0)) and len(seen) == 1


def test_nequip_loss_entries_map_to_terms() -> None:
    assert [term_of(n) for n in ("per_atom_energy_mse", "total_energy_mse", "forces_mse", "stress_mse", "x")] == [
        "energy", "energy", "force", "stress", None,
    ]  # fmt: skip
