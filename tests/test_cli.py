"""The command line: demo, run, --json, exit status 0/1/2."""

import importlib
import subprocess
import sys
import textwrap

import pytest

import gradprobe
from gradprobe.cli import build_parser, main
from gradprobe.flowmap import FlowMap

DEMO_TABLE = """\
                       eager
energy only:           12/14
force only:            10/14
virial only:           10/14
all:                   12/14"""


def test_demo_prints_the_table_and_exits_0(capsys, tmp_path):
    path = tmp_path / "f.json"
    assert main(["demo", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert DEMO_TABLE in out
    assert "energy_shift (constant per-type energy: no force/virial gradient, by construction)" in out
    assert "INFO unused-parameter" in out
    fm = FlowMap.from_json(path)
    assert fm.count("eager", "force only") == (10, 14)
    assert fm.device == "cpu" and fm.dtype == "float64"


def test_demo_options(capsys):
    assert main(["demo", "--dtype", "float32", "--mode", "weights", "--no-virial"]) == 0
    out = capsys.readouterr().out
    assert "cpu float32" in out and "virial" not in out.split("parameters reached")[1].split("\n\n")[0]


SPEC_FILE = """
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
        # BUG under test: the auxiliary head sees a detached body
        return self.head_a(h), self.head_b(h.detach() if DETACH else h)


def step(model, batch):
    a, b = model(batch)
    return {"main": a.pow(2).mean(), "aux": b.pow(2).mean()}


def spec(dtype=torch.float32):
    torch.manual_seed(0)
    return gradprobe.ProbeSpec(model=TwoHeads().to(dtype), step=step, batch=torch.randn(8, 3, dtype=dtype))


def broken():
    def no_path(model, batch):
        return {"main": model(batch)[0].sum(), "aux": model(batch)[1].sum().detach()}
    return gradprobe.ProbeSpec(model=TwoHeads(), step=no_path, batch=torch.randn(8, 3))


def not_a_spec():
    return 42
"""


@pytest.fixture
def spec_file(tmp_path):
    path = tmp_path / "probe_me.py"
    path.write_text("DETACH = True\n" + textwrap.dedent(SPEC_FILE))
    return path


def test_run_a_user_spec(spec_file, capsys):
    assert main(["run", str(spec_file), "--dtype", "float64"]) == 0
    out = capsys.readouterr().out
    assert "aux only:              2/6" in out  # the detach keeps aux from the body
    assert "cpu float64" in out


def test_run_exit_1_on_error_findings(spec_file, capsys):
    # The broken step detaches its aux term: a term that reaches nothing in the reference is an error.
    assert main(["run", f"{spec_file}:broken"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("gradprobe: PROBLEM: 1 error(s)")
    assert "ERROR dead-term: term aux reaches no parameter" in out and "aux only" in out


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("{f}:nope", "has no function 'nope'; its functions are: step, spec, broken, not_a_spec"),
        ("{f}:not_a_spec", "returned int, expected a gradprobe.ProbeSpec"),
        ("missing.py", "spec file 'missing.py' not found"),
    ],
)
def test_run_usage_errors_exit_2(spec_file, capsys, target, message):
    assert main(["run", target.format(f=spec_file)]) == 2
    assert message in capsys.readouterr().err


def test_console_script_and_module_entry_point():
    result = subprocess.run(
        [sys.executable, "-m", "gradprobe", "demo"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert DEMO_TABLE in result.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "gradprobe", "demo", "--dtype", "float8"], capture_output=True, text=True
    )
    assert bad.returncode == 2


def test_run_diagnose_exit_status(spec_file, tmp_path, capsys):
    # The spec's aux head sees a detached body while the main term still trains the body: an explicit
    # stop-gradient the step works around is a warning that asks (exit 0), and fails a job that asks
    # for it (--fail-on warning: exit 1). Without the detach it diagnoses clean (0); a term with no
    # path left to its parameters is an error (1).
    assert main(["run", str(spec_file), "--diagnose"]) == 0
    out = capsys.readouterr().out
    assert "WARNING stop-gradient: stop-gradient at" in out and "h.detach() if DETACH else h" in out
    assert main(["run", str(spec_file), "--diagnose", "--fail-on", "warning"]) == 1
    healthy = tmp_path / "healthy.py"
    healthy.write_text("DETACH = False\n" + textwrap.dedent(SPEC_FILE))
    capsys.readouterr()
    assert main(["run", str(healthy), "--diagnose", "--fail-on", "warning"]) == 0
    assert main(["run", f"{spec_file}:broken", "--diagnose"]) == 1
    assert "ERROR graph-break-in-model: aux:" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("source", "where", "message"),
    [
        ("import torch\n\ndef spec(:\n    pass\n", 3, "SyntaxError: invalid syntax"),
        (
            "import torch\nimport no_such_module_here\n",
            2,
            "ModuleNotFoundError: No module named 'no_such_module_here'",
        ),
        (
            "def spec():\n    x = 1\n    raise RuntimeError('no data in /data/train')\n",
            3,
            "RuntimeError: no data in /data/train",
        ),
        (
            "def helper():\n    return {}['model']\n\ndef spec():\n    return helper()\n",
            2,
            "KeyError: 'model'",
        ),
    ],
    ids=["syntax-error", "import-error", "spec-raises", "spec-raises-in-a-helper"],
)
def test_a_spec_file_that_fails_exits_2_naming_its_line(tmp_path, capsys, source, where, message):
    path = tmp_path / "bad_spec.py"
    path.write_text(source)
    assert main(["run", str(path)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and not captured.out, err
    assert f"{path}:{where}" in err and message in err, err


@pytest.mark.parametrize("option", ["--json", "--html", "--markdown"])
def test_an_unwritable_output_path_is_refused_before_the_probe(spec_file, tmp_path, capsys, option):
    target = tmp_path / "no_such_dir" / "out.file"
    assert main(["run", str(spec_file), option, str(target)]) == 2
    captured = capsys.readouterr()
    assert not captured.out  # nothing was probed or printed
    assert (
        "gradprobe: error:" in captured.err
        and "no_such_dir" in captured.err
        and "does not exist" in captured.err
    )
    assert main(["run", str(spec_file), option, str(tmp_path)]) == 2  # a directory
    assert "is a directory" in capsys.readouterr().err


def test_an_unavailable_device_exits_2(spec_file, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert main(["run", str(spec_file), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "gradprobe: error: --device cuda: this torch" in err and "has no CUDA device" in err
    assert "(available: cpu" in err and "Traceback" not in err
    assert main(["demo", "--device", "cuda"]) == 2
    assert "has no CUDA device" in capsys.readouterr().err
    assert main(["demo", "--device", "gpu0"]) == 2
    assert "--device gpu0: not a torch device (available: cpu" in capsys.readouterr().err


def test_a_device_torch_lacks_is_one_short_line_without_torch_s_backend_list(spec_file, capsys):
    import torch

    if torch.backends.mps.is_available():
        pytest.skip("MPS is available here")
    assert main(["run", str(spec_file), "--device", "mps"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("gradprobe: error: --device mps: this torch") and "has no MPS device" in err, err
    assert len(err.splitlines()) == 1 and len(err) < 160, err  # torch's message lists 40 dispatch keys
    assert "backends" not in err and not captured.out


@pytest.mark.parametrize(
    ("argv", "usage", "hint"),
    [
        (["run", "{f}", "--diagnsoe"], "usage: gradprobe run", "unrecognized argument --diagnsoe (did you mean --diagnose?)"),
        (["run", "{f}", "--varaints=eager"], "usage: gradprobe run", "(did you mean --variants?)"),
        (["report", "flow.json", "--hmtl", "r.html"], "usage: gradprobe report", "(did you mean --html?)"),
        (["rnu", "{f}"], "usage: gradprobe [-h]", "unknown command 'rnu' (did you mean run?); the commands are demo"),
    ],
)  # fmt: skip
def test_a_mistyped_option_or_command_gets_a_did_you_mean(spec_file, capsys, argv, usage, hint):
    with pytest.raises(SystemExit) as exit_:
        main([a.format(f=spec_file) for a in argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert usage in err and hint in err, err


@pytest.mark.parametrize(
    ("argv", "verbose"),
    [(["run", "x.py"], False), (["-v", "run", "x.py"], True), (["run", "x.py", "-v"], True),
     (["report", "f.json", "--verbose"], True), (["diff", "a.json", "b.json", "-v"], True)],
)  # fmt: skip
def test_verbose_is_taken_before_or_after_the_command(argv, verbose):
    assert build_parser().parse_args(argv).verbose is verbose


def test_report_help_and_exit_status(spec_file, tmp_path, capsys):
    # gradprobe report exits 1 when the saved map holds error findings: its --help says so.
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "exit status: 0 the map holds no error finding, 1 it holds error findings" in help_text
    assert (
        "2 the file cannot be read or is not a flow map" in help_text and "3 gradprobe crashed" in help_text
    )
    broken, healthy = tmp_path / "broken.json", tmp_path / "healthy.json"
    assert main(["run", f"{spec_file}:broken", "--json", str(broken), "--quiet"]) == 1
    assert main(["run", str(spec_file), "--json", str(healthy), "--quiet"]) == 0
    unreadable = tmp_path / "not_a_map.json"
    unreadable.write_text("{")
    assert [main(["report", str(p)]) for p in (healthy, broken, unreadable)] == [0, 1, 2]


FORCE_SPEC = """
import torch

import gradprobe
from gradprobe.variants import register_variant


class Potential(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(3, 8)
        self.out = torch.nn.Linear(8, 1)
        self.shift = torch.nn.Parameter(torch.zeros(()))

    def forward(self, positions):
        return self.out(torch.tanh(self.embed(positions))).sum() + self.shift


def step(model, batch):
    positions = batch["positions"].clone().requires_grad_(True)
    energy = model(positions)
    # dynamo breaks the graph here and resumes in this file's frame, whose globals it looks up
    (grad,) = torch.autograd.grad(energy, positions, create_graph=True)
    return {"energy": (energy - batch["energy"]).pow(2), "force": (grad + batch["forces"]).pow(2).mean()}


def own_compiled(ctx):  # the user's own compiled path
    compiled = torch.compile(ctx.weighted(), backend="eager")
    return lambda batch, weights: compiled(ctx.model, batch, weights)


register_variant("own_compiled", own_compiled)


def spec():
    torch.manual_seed(0)
    batch = {"positions": torch.randn(5, 3), "energy": torch.zeros(()), "forces": torch.zeros(5, 3)}
    return gradprobe.ProbeSpec(model=Potential(), step=step, batch=batch)
"""

EVERY_KIND = "eager,make_fx[detach=alias],compile:eager,compile_model:eager,own_compiled"


def _outcome(fm):
    counts = {(v, s): fm.count(v, s) for v in fm.variant_names for s in fm.scenario_names}
    return sorted((f.cause, f.severity) for f in fm.findings), counts


@pytest.mark.slow
def test_a_spec_file_probes_the_same_from_the_command_line_and_the_api(tmp_path, monkeypatch):
    # The command imports the file as a module that stays in sys.modules while it is probed: dynamo
    # resumes after the graph break in the step's frame and resolves its globals through it. Before,
    # every compiled variant failed with "No module named 'gradprobe_user_force_model'".
    monkeypatch.setattr("gradprobe.variants._USER_VARIANTS", {})  # the file registers own_compiled
    path = tmp_path / "force_model.py"
    path.write_text(FORCE_SPEC)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:  # the API, on the file imported as usual
        api = gradprobe.probe(
            importlib.import_module("force_model").spec(), variants=EVERY_KIND, progress=False
        )
    finally:
        sys.modules.pop("force_model", None)
    saved = tmp_path / "cli.json"
    assert main(["run", str(path), "--variants", EVERY_KIND, "--quiet", "--json", str(saved)]) == 0
    cli = FlowMap.from_json(saved)
    assert cli.variant_names == api.variant_names == tuple(EVERY_KIND.split(","))
    assert _outcome(cli) == _outcome(api)
    assert cli.count("compile:eager", "force only") == (3, 5) and api.exit_code == 0
    assert "gradprobe_user_force_model" not in sys.modules  # importable while probed, removed after
