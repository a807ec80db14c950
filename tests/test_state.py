"""The probe leaves the user's model exactly as it found it."""

import random
import sys
from typing import Any

import pytest
import torch
from messy_model import Messy
from torch import nn

import gradprobe


def step(model, batch):
    a, b = model(batch)
    # A step with side effects on the model: in-place edits of a parameter and of .grad.
    with torch.no_grad():
        model.head_a.bias.add_(1.0)
    model.head_b.weight.grad = torch.full_like(model.head_b.weight, 7.0)
    model.train()
    return {"a": a.pow(2).mean(), "b": b.pow(2).mean()}


def weights_step(model, batch, weights):
    terms = step(model, batch)
    return weights["a"] * terms["a"] + weights["b"] * terms["b"]


def snapshot(model):
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "grad_ids": {n: id(p.grad) for n, p in model.named_parameters()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "modes": {n: m.training for n, m in model.named_modules()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "rng": torch.get_rng_state(),
        "py_rng": random.getstate(),
        "grad_mode": torch.is_grad_enabled(),
    }


def assert_same(before, after):
    for key in ("params", "buffers"):
        for n, t in before[key].items():
            assert torch.equal(t, after[key][n]), f"{key} {n} changed"
    for n, g in before["grads"].items():
        assert (g is None) == (after["grads"][n] is None), n
        if g is not None:
            assert torch.equal(g, after["grads"][n]), f"grad {n} changed"
    assert before["grad_ids"] == after["grad_ids"], "the .grad objects were replaced"
    for key in ("requires_grad", "modes", "py_rng", "grad_mode"):
        assert before[key] == after[key], key
    assert torch.equal(before["rng"], after["rng"])


@pytest.mark.parametrize(("the_step", "mode"), [(step, "terms"), (weights_step, "weights")])
@pytest.mark.parametrize("grad_mode", [True, False])
def test_model_state_is_restored(the_step, mode, grad_mode):
    torch.manual_seed(0)
    model = Messy()
    model.inp.weight.grad = torch.ones_like(model.inp.weight)  # the user has pending grads
    batch = torch.randn(16, 3)
    before = snapshot(model)
    torch.set_grad_enabled(grad_mode)
    try:
        before["grad_mode"] = grad_mode
        fm = gradprobe.probe(model, the_step, batch, terms=["a", "b"], mode=mode)
        after = snapshot(model)
    finally:
        torch.set_grad_enabled(True)
    assert_same(before, after)
    # The probe measured something real while it was at it.
    assert "head_a.weight" in fm.reached("eager", "a only")
    assert fm.cell("eager", "a only", "frozen.weight").status == "none"
    assert fm.count("eager", "all")[1] == 8  # frozen parameters are not counted as trainable


def test_state_restored_when_the_step_raises_a_contract_error():
    model = Messy()
    batch = torch.randn(4, 3)
    before = snapshot(model)

    def bad(m, b):
        m(b)
        with torch.no_grad():
            m.inp.weight.mul_(0)
        return {"a": torch.ones(3, requires_grad=True)}  # not a scalar

    with pytest.raises(gradprobe.StepContractError):
        gradprobe.probe(model, bad, batch)
    assert_same(before, snapshot(model))


def test_batch_is_not_modified_by_differentiable_inputs():
    model = nn.Linear(3, 1)
    batch = {"x": torch.randn(4, 3)}

    def f(m, b):
        assert b["x"].requires_grad
        return {"y": m(b["x"]).sum()}

    gradprobe.probe(model, f, batch, differentiable_inputs=["x"])
    assert not batch["x"].requires_grad


class _GradIsTheInput(torch.autograd.Function):
    """A custom function whose backward hands back a tensor it saved from the batch, as is."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return (w * x).sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        return x, None  # right for grad == 1, and the very tensor of the user's batch


def test_a_gradient_that_is_the_users_batch_is_never_written_into():
    # Summing the two terms' gradients for "all" must not accumulate into the first one in place:
    # autograd returned the user's batch tensor itself as that gradient.
    model = nn.Module()
    model.weight = nn.Parameter(torch.ones(3))
    batch = torch.tensor([1.0, 2.0, 3.0])

    def step(m: nn.Module, b: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"a": _GradIsTheInput.apply(m.weight, b), "b": _GradIsTheInput.apply(m.weight, b)}

    fm = gradprobe.probe(model, step, batch)
    assert torch.equal(batch, torch.tensor([1.0, 2.0, 3.0]))
    assert fm.cell("eager", "all", "weight").norm == pytest.approx(12.0)


class Stateful(nn.Module):
    """Attributes a forward changes: a counter, a stored activation, and old-style weight_norm's
    ``weight``, recomputed from ``weight_g``/``weight_v`` by a forward pre-hook."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.utils.weight_norm(nn.Linear(3, 2))
        self.head = nn.Linear(2, 1)
        self.calls = 0
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.last = self.lin(x)
        return self.head(torch.tanh(self.last))


def _attributes(model: nn.Module) -> dict[str, dict[str, Any]]:
    return {n: dict(vars(m)) for n, m in model.named_modules()}


def _containers(model: nn.Module) -> dict[str, dict[str, list[Any]]]:
    return {
        n: {
            k: list(v)
            for k, v in vars(m).items()
            if isinstance(v, dict) and (k.startswith("_") or "hooks" in k)
        }
        for n, m in model.named_modules()
    }


def test_module_attributes_a_step_changes_are_put_back():
    torch.manual_seed(0)
    model = Stateful()
    x = torch.randn(5, 3)
    model(x)  # the user's own forward: calls == 1, last and lin.weight hold its results
    before, containers = _attributes(model), _containers(model)

    def step(m: Stateful, b: torch.Tensor) -> dict[str, torch.Tensor]:
        m.scratch = "added by the step"
        m.head.register_forward_hook(lambda *args: None)
        m.lin.weight_v.register_hook(lambda g: g)
        m.head.bias = nn.Parameter(torch.zeros(1))  # a replaced parameter
        y = m(b)
        return {"fit": y.pow(2).mean(), "reg": m.lin.weight_g.abs().sum()}

    fm = gradprobe.probe(model, step, x, variants="eager,make_fx", second_batch=x + 1)
    assert fm.count("eager", "fit only")[0] > 0
    after = _attributes(model)
    assert after.keys() == before.keys()
    for name, attrs in before.items():
        assert after[name].keys() == attrs.keys(), name  # "scratch" is gone
        changed = [k for k, v in attrs.items() if after[name][k] is not v]
        assert not changed, (name, changed)  # calls, last, lin.weight, head's parameters: the user's objects
    assert _containers(model) == containers  # no hook, parameter or buffer added or replaced
    assert model.calls == 1 and not model.lin.weight_v._backward_hooks


class Tied(nn.Module):
    """A plain layer, BatchNorm, a transposed (non-contiguous) parameter, an expanded (overlapping)
    buffer, and an integer buffer."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.norm = nn.BatchNorm1d(4)
        self.wt = nn.Parameter(torch.randn(2, 4).t())  # (4, 2), strides (1, 4)
        self.register_buffer("scale", torch.ones(4, 1).expand(4, 2))  # stride 0: elements share memory
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))

    def forward(self, x):
        return (self.norm(self.lin(x)) @ self.wt * self.scale[0]).sum(1)


class Plain(Tied):
    """Tied's members, every one contiguous: a model whose tensors the probe saves as bytes."""

    def __init__(self):
        super().__init__()
        self.wt = nn.Parameter(torch.randn(4, 2))
        self.register_buffer("scale", torch.ones(4, 2))


def _values(model):
    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {
        n: (t.detach().clone(), t.data_ptr(), t.dtype, t.shape, t.stride(), t._version)
        for n, t in named.items()
    }


@pytest.mark.parametrize(
    "edit",
    [
        "data_mul",  # through p.data: a version counter of its own, p._version never moves
        "numpy",  # through NumPy: no version counter at all
        "no_grad_inplace",
        "data_replaced",  # p.data = another tensor
        "dtype_view",  # same storage, sizes and strides, another dtype (a buffer: parameters refuse)
        "resized",
        "grad_data",  # the user's .grad object edited through .data
        "strided_and_overlapping",  # compared, then copied back
        "int_buffer",
    ],
)
@pytest.mark.parametrize("kind", [Tied, Plain], ids=["torch-copies", "bytes"])
def test_writes_no_version_counter_sees_are_undone(edit, kind):
    torch.manual_seed(0)
    model = kind()
    model.lin.bias.grad = torch.full_like(model.lin.bias, 3.0)
    grad = model.lin.bias.grad
    before = _values(model)
    grad_before = grad.clone()

    def step(m, x):
        y = m(x)
        w = m.lin.weight
        if edit == "data_mul":
            w.data.mul_(2)
        elif edit == "numpy":
            w.detach().numpy()[...] = 0.0
        elif edit == "no_grad_inplace":
            with torch.no_grad():
                w.add_(1.0)
        elif edit == "data_replaced":
            w.data = torch.zeros_like(w)
        elif edit == "dtype_view":
            m.norm.running_var.data = m.norm.running_var.data.view(torch.int32)
        elif edit == "resized":
            w.data.resize_(2, 2)
        elif edit == "grad_data":
            grad.data.fill_(-1.0)
        elif edit == "strided_and_overlapping":
            m.wt.data.mul_(3)
            m.scale.data.fill_(5.0)
        elif edit == "int_buffer":
            m.steps.data.add_(7)
        return {"a": y[:2].sum(), "b": y[2:].pow(2).sum()}

    gradprobe.probe(model, step, torch.randn(8, 3))
    after = _values(model)
    # Bumped by the step itself (BatchNorm's num_batches_tracked.add_(1) in train mode, the in-place
    # add under no_grad); the running statistics, updated in-kernel, keep theirs.
    bumped = {"norm.num_batches_tracked"} | ({"lin.weight"} if edit == "no_grad_inplace" else set())
    for n, (value, ptr, dtype, shape, stride, version) in before.items():
        v2, ptr2, dtype2, shape2, stride2, version2 = after[n]
        assert (dtype2, shape2, stride2) == (dtype, shape, stride), n
        assert ptr2 == ptr, f"{n}: not back on its own storage"
        assert torch.equal(v2, value), f"{n} changed"
        if n not in bumped:
            assert version2 == version, f"{n}: version counter moved ({version} -> {version2})"
    assert model.lin.bias.grad is grad and torch.equal(grad, grad_before)
    assert model.lin.weight.grad is None


def test_a_parameter_whose_storage_the_step_grows_is_put_back():
    """A step that grows a parameter's storage (its memory moves) still gets it back: values, sizes,
    strides and dtype as before."""
    torch.manual_seed(0)
    model = Plain()
    before = _values(model)

    def step(m, x):
        y = m(x)
        m.lin.weight.data.resize_(64, 64).fill_(7.0)  # a bigger storage: new memory, old values copied
        return {"a": y[:2].sum(), "b": y[2:].pow(2).sum()}

    gradprobe.probe(model, step, torch.randn(8, 3), progress=False)
    after = _values(model)
    for n, (value, _, dtype, shape, stride, _) in before.items():
        v2, _, dtype2, shape2, stride2, _ = after[n]
        assert (dtype2, shape2, stride2) == (dtype, shape, stride), n
        assert torch.equal(v2, value), f"{n} changed"


def test_an_autograd_graph_saved_before_the_probe_is_still_usable():
    """Parameters the step leaves alone keep their version counters: a graph built before the probe,
    which saved them for backward, can be backpropagated after it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(5, 3)
    loss = model(x).pow(2).sum()  # saves the weights for backward
    expected = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    gradprobe.probe(model, lambda m, b: {"y": m(b).sum()}, x)
    got = torch.autograd.grad(loss, list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_a_sparse_grad_the_user_holds_is_restored():
    emb = nn.Embedding(5, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    grad = emb.weight.grad
    dense = grad.to_dense().clone()

    def step(m, idx):
        m.weight.grad.data = torch.zeros(5, 3).to_sparse()
        return {"y": m(idx).pow(2).sum()}

    fm = gradprobe.probe(emb, step, torch.tensor([0, 4]))
    assert fm.count("eager", "y only") == (1, 1)
    assert emb.weight.grad is grad and grad.is_sparse and torch.equal(grad.to_dense(), dense)


def test_config_values_a_step_edits_in_place_are_put_back():
    # The config snapshot reads torch's cached values and copies only the mutable ones: an in-place
    # edit (of a value set before, and of a default never read before the probe) must still be undone.
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    dynamo_config.reorderable_logging_functions = {print}
    fusion_before = dict(inductor_config.post_grad_fusion_options)
    limit_before = dynamo_config.recompile_limit

    def editing_step(model, batch):
        dynamo_config.reorderable_logging_functions.add(len)
        inductor_config.post_grad_fusion_options["gradprobe_test"] = {}
        dynamo_config.recompile_limit = limit_before + 5
        return {"a": model(batch).pow(2).mean()}

    try:
        gradprobe.probe(nn.Linear(2, 1), editing_step, torch.ones(3, 2), progress=False)
        assert dynamo_config.reorderable_logging_functions == {print}
        assert dict(inductor_config.post_grad_fusion_options) == fusion_before
        assert dynamo_config.recompile_limit == limit_before
    finally:
        dynamo_config.reorderable_logging_functions = set()
        inductor_config.post_grad_fusion_options = fusion_before
        dynamo_config.recompile_limit = limit_before


def test_config_set_on_any_config_module_is_undone_without_a_copy(monkeypatch):
    # The probe runs in a copy of the context: what a step sets on a config module (ContextVars) is
    # gone after it, also on a config module gradprobe does not list (torch.fx.experimental._config),
    # and without reading the values of the modules it lists.
    from torch.fx.experimental import _config as fx_config

    from gradprobe import process_state as state

    if not state.CONTEXT_CONFIG:
        pytest.skip("config values are not ContextVars on this torch")
    before = fx_config.translation_validation

    def reads_nothing(name):  # a config module read value by value would fail the probe
        def read():
            raise AssertionError(f"{name} was read: the copy of the context should isolate it")

        return read

    monkeypatch.setattr(
        state, "GLOBALS", [g if not g.contextual else state.Global(g.name, reads_nothing(g.name), g.write, g.same, True)
                           for g in state.GLOBALS],
    )  # fmt: skip

    def setting_step(model, batch):
        fx_config.translation_validation = not before
        return {"a": model(batch).pow(2).mean()}

    gradprobe.probe(nn.Linear(2, 1), setting_step, torch.ones(3, 2), progress=False)
    assert fx_config.translation_validation == before


def test_config_module_first_imported_by_the_step_keeps_what_was_set_there(tmp_path, monkeypatch):
    # As before the copy of the context: only config modules imported before the probe are put back;
    # one the step imports keeps what its import and the step set (it was never the user's state).
    (tmp_path / "gradprobe_fresh_config.py").write_text(
        "import sys\nfrom torch.utils._config_module import install_config_module\n"
        "flag = False\nlimit = 1\ninstall_config_module(sys.modules[__name__])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    def importing_step(model, batch):
        import gradprobe_fresh_config

        gradprobe_fresh_config.flag = True
        return {"a": model(batch).pow(2).mean()}

    try:
        gradprobe.probe(nn.Linear(2, 1), importing_step, torch.ones(3, 2), progress=False)
        import gradprobe_fresh_config

        assert gradprobe_fresh_config.flag is True and gradprobe_fresh_config.limit == 1
    finally:
        sys.modules.pop("gradprobe_fresh_config", None)


def test_python_rng_is_put_back_exactly():
    # A step that reseeds and draws (a Gaussian, which caches the pair's second value) leaves Python's
    # global RNG as found, with and without a cached Gaussian; reseeding is random.seed.
    import random

    from gradprobe.rng import reseed

    def step(m, b):  # type: ignore[no-untyped-def]
        random.seed(99)
        noise = random.gauss(0.0, 1.0)  # caches the pair's second value
        return {"fit": m(b).sum().square() * (1.0 + 0.0 * noise)}

    model = nn.Linear(2, 1)
    for cached in (False, True):
        random.seed(7)
        random.random()
        if cached:
            random.gauss(0.0, 1.0)
        before = random.getstate()
        assert (before[2] is not None) == cached
        gradprobe.probe(model, step, torch.ones(4, 2), progress=False)
        assert random.getstate() == before
    for seed in (0, 5, 2**40 + 3):
        random.gauss(0.0, 1.0)
        reseed(seed)
        seeded = random.getstate()
        random.seed(seed)
        assert seeded == random.getstate()


def test_flush_denormal_set_by_a_step_is_put_back():
    def flushing_step(model, batch):
        torch.set_flush_denormal(True)
        return {"a": model(batch).pow(2).mean()}

    if not torch.set_flush_denormal(False):
        pytest.skip("flush-denormal is not supported on this CPU")
    gradprobe.probe(nn.Linear(2, 1), flushing_step, torch.ones(3, 2), progress=False)
    tiny = torch.full((1,), 1e-310, dtype=torch.float64)
    assert (tiny * 1.0).item() != 0.0, "denormals still flushed after the probe"


def test_one_walk_lists_what_torch_lists():
    # The probe walks the module tree once for modules, parameters and buffers: the same objects,
    # names and order as torch's three walks, shared and tied members listed once under their first name.
    from gradprobe.walk import walk

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Linear(3, 3)
            self.dec = nn.Linear(3, 3)
            self.dec.weight = self.enc.weight  # tied
            self.again = self.enc  # a module listed twice
            self.norm = nn.BatchNorm1d(3)
            self.register_buffer("empty", None)
            self.scale = nn.Parameter(torch.ones(1))

    for model in (Tied(), Messy(), nn.TransformerEncoderLayer(8, 2)):
        tree = walk(model)
        assert tree.modules == list(model.modules())
        for mine, theirs in (
            (tree.parameters, model.named_parameters()),
            (tree.buffers, model.named_buffers()),
        ):
            theirs = list(theirs)
            assert [n for n, _ in mine] == [n for n, _ in theirs]
            assert all(a is b for (_, a), (_, b) in zip(mine, theirs, strict=True))


def test_numpy_rng_with_a_cached_gaussian_is_put_back_exactly():
    # NumPy's legacy RNG is restored through its MT19937 state after a reseed where the saved state
    # holds no cached Gaussian, and through set_state where it does: both exactly as found.
    np = pytest.importorskip("numpy")
    model = nn.Linear(2, 1)

    def step(m, b):  # type: ignore[no-untyped-def]
        noise = torch.from_numpy(np.random.standard_normal(3).astype("float32"))  # draws, caches one
        return {"fit": (m(b).sum() + noise.sum()).square()}

    for cached in (False, True):
        np.random.seed(7)
        np.random.rand(5)
        if cached:
            np.random.standard_normal()  # an odd number of normals: the second one is cached
        before = np.random.get_state()
        assert before[3] == int(cached)
        gradprobe.probe(model, step, torch.ones(4, 2), progress=False)
        after = np.random.get_state()
        assert after[0] == before[0] and (after[1] == before[1]).all() and after[2:] == before[2:]


def _bits_and_versions(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Each parameter's bits (as int32) and its version counter."""
    named = list(model.named_parameters())
    return {n: p.detach().clone().view(torch.int32) for n, p in named}, {n: p._version for n, p in named}


def _assert_bit_for_bit(model: nn.Module, bits: dict[str, torch.Tensor], versions: dict[str, int]) -> None:
    for n, p in model.named_parameters():
        assert torch.equal(p.detach().view(torch.int32), bits[n]), f"{n}: not bit for bit as before"
        assert p._version == versions[n], n


@pytest.mark.parametrize("edit", ["negative_zero", "nan_payload", "one_element", "none"])
def test_tensors_are_put_back_bit_for_bit(edit):
    """A change torch.equal would miss (0.0 to -0.0, another NaN payload) is undone, and values the
    step left alone stay as they were, version counters included."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    with torch.no_grad():
        model[0].bias[0] = 0.0
        if edit == "nan_payload":  # only here: a NaN makes a value comparison see a change anyway
            model[2].bias[1] = float("nan")
    bits, versions = _bits_and_versions(model)

    def step(m, x):
        if edit == "negative_zero":
            m[0].bias.data[0] = -0.0
        elif edit == "nan_payload":
            m[2].bias.data.view(torch.int32)[1] = 0x7FC00001  # a NaN with another payload
        elif edit == "one_element":
            m[2].weight.data[1, 3] += 1e-7
        y = m(x)
        return {"a": y[:, 0].sum(), "b": y[:, 1].sum()}

    gradprobe.probe(model, step, torch.randn(5, 3), progress=False)
    _assert_bit_for_bit(model, bits, versions)


@pytest.mark.parametrize("edit", ["large", "small", "both", "none"])
def test_large_tensors_compared_alone_are_put_back_bit_for_bit(edit):
    """Tensors large enough to be compared alone against their part of the saved copy (no second
    concatenated copy at restore) are put back like the small ones, and only what the step wrote is
    written: the others keep their version counters."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 256), nn.Tanh(), nn.Linear(256, 300), nn.Tanh(), nn.Linear(300, 2))
    assert model[0].weight.numel() >= 1 << 16 and model[2].weight.numel() >= 1 << 16
    bits, versions = _bits_and_versions(model)

    def step(m, x):
        if edit in ("large", "both"):
            m[2].weight.data[7, 11] = -0.0  # behind the version counter, in the second large tensor
        if edit in ("small", "both"):
            m[4].bias.data.mul_(3)
        y = m(x)
        return {"a": y[:, 0].sum(), "b": y[:, 1].sum()}

    gradprobe.probe(model, step, torch.randn(4, 300), progress=False)
    _assert_bit_for_bit(model, bits, versions)


def test_cublas_reduced_precision_settings_are_put_back_with_their_split_k_flag():
    # cuBLAS keeps two flags per setting (reduced precision, split-k); the attribute sets both from
    # one bool. The probe reads and writes the pair, so a user's split-k choice survives a step that
    # sets the attribute.
    get = torch._C._get_cublas_allow_fp16_reduced_precision_reduction
    put = torch._C._set_cublas_allow_fp16_reduced_precision_reduction
    before = get()

    def step(m, b):
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = True
        return {"a": m(b).pow(2).mean()}

    try:
        put(False, False)  # setting the attribute back to False would give (False, True)
        gradprobe.probe(nn.Linear(2, 1), step, torch.ones(3, 2), progress=False)
        assert get() == (False, False)
    finally:
        put(*before)


def test_reseeding_numpy_is_numpy_seed():
    # The state reseed leaves is exactly np.random.seed's, with and without a Gaussian cached before.
    np = pytest.importorskip("numpy")
    from gradprobe.rng import reseed

    np.random.seed(1)
    for cached in (False, False, True):
        if cached:
            np.random.standard_normal()
        reseed(5)
        got = np.random.get_state()
        np.random.seed(5)
        expected = np.random.get_state()
        assert (got[1] == expected[1]).all() and got[2:] == expected[2:]
        np.random.rand(7)  # moves on: the next reseed must write the words back
