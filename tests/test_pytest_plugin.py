"""The pytest plugin as a user meets it: the snapshot fixture, --gradprobe-update, readable failures."""

# pytester's in-process runs drop the modules first imported inside them; torch._dynamo registers C++
# operator libraries on import, which cannot run twice. Imported here, it stays loaded (a file run alone
# failed with "Only a single TORCH_LIBRARY can be used to register the namespace _inductor_test").
import torch._dynamo  # noqa: F401

TEST_FILE = """
import os
import torch
import gradprobe


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(3, 4)
        self.head = torch.nn.Linear(4, 1)
        self.aux = torch.nn.Linear(4, 1)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        h_aux = h.detach() if os.environ.get("GP_BUG") else h
        return self.head(h), self.aux(h_aux)


def step(model, x):
    a, b = model(x)
    return {"main": a.pow(2).mean(), "aux": b.pow(2).mean()}


def test_flow(gradprobe_snapshot):
    torch.manual_seed(1)
    fm = gradprobe.probe(TwoHeads(), step, torch.randn(8, 3))
    gradprobe_snapshot.match(fm)


def test_assert(monkeypatch):
    from gradprobe.testing import assert_grad_flow

    torch.manual_seed(1)
    fm = gradprobe.probe(TwoHeads(), step, torch.randn(8, 3))
    assert_grad_flow(fm, reaches={"aux only": ["body"]})
"""


def test_snapshot_fixture_update_and_regression(pytester, monkeypatch):
    pytester.makepyfile(test_user=TEST_FILE)
    missing = pytester.runpytest("-k", "test_flow", "-p", "no:cacheprovider")
    missing.assert_outcomes(failed=1)
    missing.stdout.fnmatch_lines(
        ["*no gradprobe snapshot at *test_flow.flow.json: run pytest with --gradprobe-update*"]
    )

    pytester.runpytest("-k", "test_flow", "--gradprobe-update").assert_outcomes(passed=1)
    assert (pytester.path / "__gradprobe__" / "test_flow.flow.json").is_file()
    pytester.runpytest("-k", "test_flow").assert_outcomes(passed=1)

    monkeypatch.setenv("GP_BUG", "1")
    broken = pytester.runpytest("-k", "test_flow")
    broken.assert_outcomes(failed=1)
    broken.stdout.fnmatch_lines([
        "*gradient flow differs from the snapshot test_flow.flow.json*",
        "*aux only in eager: body.weight nonzero → none*",
        "*rerun with --gradprobe-update to rewrite the snapshot*",
    ])  # fmt: skip


def test_assert_grad_flow_message(pytester, monkeypatch):
    pytester.makepyfile(test_user=TEST_FILE)
    pytester.runpytest("-k", "test_assert").assert_outcomes(passed=1)
    monkeypatch.setenv("GP_BUG", "1")
    result = pytester.runpytest("-k", "test_assert")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*gradient flow broken:*",
        "*aux only in eager: expected to reach body.weight, body.bias, but it does not*",
    ])  # fmt: skip


def test_plugin_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, _gradprobe_pytest; print('torch' in sys.modules, 'gradprobe' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


FACTORY_FILE = """
import os
import torch
import gradprobe


def make():
    # No seed here: gradprobe seeds the factory with spec.seed (torch's default seed differs per process)
    return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


def step(model, x):
    y = model(x)
    return {"a": y[:, 0].pow(2).mean(), "b": y[:, 1].abs().mean()}


def test_factory(gradprobe_snapshot):
    model = make() if os.environ.get("GP_OUTSIDE") else make
    gradprobe_snapshot.match(gradprobe.probe(model, step, torch.ones(4, 3), seed=int(os.environ.get("GP_SEED", "0"))))
"""


def test_a_factory_snapshot_matches_in_every_process(pytester, monkeypatch):
    pytester.makepyfile(test_factory=FACTORY_FILE)
    # Each run is its own process: torch starts from a different default seed in each.
    pytester.runpytest_subprocess("--gradprobe-update").assert_outcomes(passed=1)
    for _ in range(2):
        pytester.runpytest_subprocess().assert_outcomes(passed=1)
    # Another seed builds other weights: the flow is the same, only norms move, and the failure says so.
    monkeypatch.setenv("GP_SEED", "7")
    moved = pytester.runpytest_subprocess()
    moved.assert_outcomes(failed=1)
    moved.stdout.fnmatch_lines(
        [
            "*gradient norms differ from the snapshot test_factory.flow.json*",
            "*The flow is the same (every status, verdict, run error and error finding matches); only norms*",
        ]
    )
    assert "gradient flow differs" not in moved.stdout.str()


def test_the_factory_seed_leaves_the_callers_rng_alone():
    import torch

    import gradprobe

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    gradprobe.probe(lambda: torch.nn.Linear(2, 1), lambda m, b: {"y": m(b).sum()}, torch.ones(1, 2))
    assert torch.equal(torch.rand(3), expected)
