"""The pytest plugin as a user meets it: the snapshot fixture, --gradprobe-update, readable failures."""

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
