"""Status reduction: the five statuses, and no underflow/overflow in the test for non-zero."""

import math

import pytest
import torch

import gradprobe.status
from gradprobe.status import Stacked, Stacking, read, reduce_grads, status_of


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
    # Several gradient lists read at once (one batched norm over all of them): each gradient gets
    # its own status and norm, Nones and non-finite values included, and ``extra`` comes back as floats.
    torch.manual_seed(0)
    shapes = [(4,), (4, 4), (3,), (2, 2)]
    grads: list[torch.Tensor | None] = []
    for i in range(300):
        g = torch.randn(shapes[i % 4])
        grads.append(None if i % 11 == 0 else torch.zeros_like(g) if i % 7 == 0 else g)
    grads[5] = torch.full((4, 4), math.nan)
    grads[13] = torch.tensor([math.inf, 1.0, 2.0, 3.0])
    grads[9] = torch.full((4,), 1e38)  # finite: its float32 L1 sum overflows
    (first, second), extra = read(
        [_held(grads), _held(grads[::-1])], torch.tensor([1.5, -2.0], dtype=torch.float64)
    )
    assert extra == [1.5, -2.0]
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


def _held(grads: list[torch.Tensor | None]) -> Stacked:
    return Stacking(grads).stack(grads)


def test_nothing_to_read():
    assert read([]) == ([], None)
    assert read([_held([None, None]), _held([])]) == ([(["none", "none"], [None, None]), ([], [])], None)
    assert read([], torch.tensor([2.0])) == ([], [2.0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_each_dtype_is_accumulated_without_overflow_and_read_exactly(dtype):
    ones = torch.ones(70_000, dtype=dtype)  # float16's largest finite value is 65,504
    halves = torch.full((3,), -0.5, dtype=dtype)
    statuses, norms = reduce_grads([ones, halves, torch.zeros(2, dtype=dtype), None])
    assert statuses == ["nonzero", "nonzero", "zero", "none"]
    assert norms == [70_000.0, 1.5, 0.0, None]


def test_finite_sums_past_float32_and_float64_are_finite_norms():
    # float32 values whose L1 sum passes float32's range: the norm comes out finite (in float64);
    # float64 values whose sum passes float64's: nonzero, the norm inf (nothing wider to hold it).
    statuses, norms = reduce_grads(
        [
            torch.full((10_000,), 1e36),
            torch.full((4,), 1e308, dtype=torch.float64),
            torch.tensor([3e38, -1.0]),
        ]
    )
    assert statuses == ["nonzero", "nonzero", "nonzero"]
    assert norms[0] == pytest.approx(1e40, rel=1e-5) and norms[1] == math.inf
    assert norms[2] == pytest.approx(3e38, rel=1e-6)


def test_complex_gradients_are_judged_on_their_modulus():
    statuses, norms = reduce_grads(
        [
            torch.tensor([3 + 4j, 0j]),
            torch.zeros(2, dtype=torch.complex128),
            torch.tensor([complex(math.nan, 0.0)]),
            torch.tensor([complex(0.0, math.inf)]),
        ]
    )
    assert statuses == ["nonzero", "zero", "nan", "inf"]
    assert norms[:2] == [5.0, 0.0]


def test_sparse_gradients_with_zeros_nan_and_inf():
    def sparse(values: list[float]) -> torch.Tensor:
        return torch.sparse_coo_tensor([list(range(len(values)))], values, (8,))

    statuses, norms = reduce_grads(
        [sparse([0.0, 0.0]), sparse([]), sparse([1.0, math.nan]), sparse([math.inf]), sparse([2.0, -2.0])]
    )
    assert statuses == ["zero", "zero", "nan", "inf", "nonzero"]
    assert norms[0] == 0.0 and norms[1] == 0.0 and norms[4] == 4.0


def test_every_status_is_decided_by_status_of(monkeypatch):
    # The module's status_of, looked up at each call, decides every status read from a number (a test
    # that swaps it in sees it called for every present gradient, the nonzero ones included).
    seen: list[float] = []
    original = gradprobe.status.status_of

    def judge(value: float) -> str:
        seen.append(value)
        return original(value)

    monkeypatch.setattr(gradprobe.status, "status_of", judge)
    grads = [torch.ones(2), None, torch.zeros(3), torch.tensor([2.0, math.nan]), torch.full((2,), 3e38)]
    statuses, _ = reduce_grads(grads)
    assert statuses == ["nonzero", "none", "zero", "nan", "nonzero"]
    assert len(seen) >= 4 and 2.0 in seen and 0.0 in seen and any(map(math.isnan, seen))
    monkeypatch.setattr(gradprobe.status, "status_of", lambda value: "zero")
    assert reduce_grads([torch.ones(3), torch.ones(5)])[0] == ["zero", "zero"]


def test_sums_are_out_of_place_and_read_as_per_parameter_sums():
    # Gradient lists held for a probe's parameters (many small ones of a shape stacked), summed: the
    # sum of two lists is read as the sum of their gradients, None + g = g, and no tensor of either
    # list is written into (autograd may hand back a tensor someone else holds).
    torch.manual_seed(0)
    params = [torch.zeros(4) for _ in range(40)] + [torch.zeros(3, 3), torch.zeros(1000)]
    stacking = Stacking(params)

    def grads(missing: int) -> list[torch.Tensor | None]:
        return [None if i % 5 == missing else torch.randn(p.shape) for i, p in enumerate(params)]

    a, b = grads(0), grads(1)
    b[7] = torch.sparse_coo_tensor([[1, 3]], [1.0, -2.0], (4,))  # a sparse gradient of a dense parameter
    b[40] = None
    b[41] = torch.sparse_coo_tensor([[5]], [3.0], (1000,))
    before = [None if g is None else g.clone() for g in a + b]
    total = stacking.stack(a) + stacking.stack(b)
    assert all(
        (g is None and h is None) or torch.equal(g.to_dense(), h.to_dense())  # type: ignore[union-attr]
        for g, h in zip(a + b, before, strict=True)
    )
    expected = [
        x if y is None else y.to_dense() if x is None else x + y.to_dense() for x, y in zip(a, b, strict=True)
    ]
    got = total.grads()
    for g, e in zip(got, expected, strict=True):
        assert (g is None) == (e is None) and (g is None or torch.equal(g.to_dense(), e))  # type: ignore[union-attr]
    ((statuses, norms),), _ = read([total])
    assert statuses == ["none" if e is None else "nonzero" for e in expected]
    for norm, e in zip(norms, expected, strict=True):
        assert norm == (None if e is None else pytest.approx(float(e.double().abs().sum()), rel=1e-5))
