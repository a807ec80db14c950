"""Status reduction: the five statuses, and no underflow/overflow in the test for non-zero."""

import math

import pytest
import torch

from gradprobe.status import launch, read, reduce_grads, status_of


def test_five_statuses_in_one_batch():
    grads = [
        None,
        torch.zeros(3),
        torch.tensor([0.0, -2.0]),
        torch.tensor([1.0, float("nan")]),
        torch.tensor([float("inf"), 1.0]),
        torch.tensor([float("inf"), float("nan")]),
    ]
    statuses, norms = reduce_grads(grads)
    assert statuses == ["none", "zero", "nonzero", "nan", "inf", "nan"]
    assert norms[0] is None and norms[1] == 0.0 and norms[2] == 2.0


@pytest.mark.parametrize(
    ("value", "dtype"),
    [
        (1e-30, torch.float32),
        (1e-40, torch.float32),
        (1e-200, torch.float64),
        (1e-320, torch.float64),
        (1e-7, torch.float16),
    ],
)
def test_tiny_gradients_are_nonzero(value, dtype):
    # An L2 norm squares these to zero; the status must still say nonzero.
    g = torch.full((1000,), value, dtype=dtype)
    assert g.abs().max() > 0, "test value must be representable"
    statuses, norms = reduce_grads([g])
    assert statuses == ["nonzero"]
    assert norms[0] > 0


def test_float16_norm_accumulates_without_overflow():
    statuses, norms = reduce_grads([torch.ones(100_000, dtype=torch.float16)])
    assert statuses == ["nonzero"] and norms[0] == pytest.approx(100_000)


def test_huge_finite_float32_is_not_called_inf():
    # The L1 sum overflows float32, but no element is infinite.
    statuses, _ = reduce_grads([torch.full((10,), 3e38, dtype=torch.float32)])
    assert statuses == ["nonzero"]


def test_mixed_dtypes_and_sparse():
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, -3.0], (5,))
    statuses, norms = reduce_grads(
        [torch.ones(2, dtype=torch.float64), sparse, torch.zeros(2, dtype=torch.bfloat16)]
    )
    assert statuses == ["nonzero", "nonzero", "zero"]
    assert norms[:2] == [2.0, 4.0]


def test_status_of():
    assert [status_of(x) for x in (0.0, 1e-300, math.nan, math.inf)] == ["zero", "nonzero", "nan", "inf"]


def test_many_gradients_of_mixed_shapes_keep_their_own_status_and_norm():
    # Gradients of one shape are stacked and reduced together (16 or more of a shape), then read back
    # in another order than given: each must get its own status and norm, Nones and non-finite
    # values included, with several pending reductions read at once.
    torch.manual_seed(0)
    shapes = [(4,), (4, 4), (3,), (2, 2)]
    grads: list[torch.Tensor | None] = []
    for i in range(300):
        g = torch.randn(shapes[i % 4])
        grads.append(None if i % 11 == 0 else torch.zeros_like(g) if i % 7 == 0 else g)
    grads[5] = torch.full((4, 4), math.nan)
    grads[13] = torch.tensor([math.inf, 1.0, 2.0, 3.0])
    grads[9] = torch.full((4,), 1e38)  # finite: its float32 L1 sum overflows
    (first, second), _ = read([launch(grads), launch(grads[::-1])])
    for (statuses, norms), gs in ((first, grads), (second, grads[::-1])):
        for g, st, norm in zip(gs, statuses, norms, strict=True):
            if g is None:
                assert st == "none" and norm is None
                continue
            exact = g.abs().double().sum().item()
            if math.isnan(exact):
                assert st == "nan"
            elif math.isinf(exact):
                assert st == "inf"
            else:
                assert st == ("zero" if exact == 0 else "nonzero")
                assert norm == pytest.approx(exact, rel=1e-5)
