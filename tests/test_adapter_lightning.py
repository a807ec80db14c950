"""The Lightning callback, inside a real ``Trainer.fit`` on CPU: the report exists, names the unused head,
the run continues; ``fail_on_error`` stops a run whose step has a broken term; the module is unharmed."""

from __future__ import annotations

import json

import pytest
import torch

L = pytest.importorskip("lightning.pytorch")

from examples_loader import load_example  # noqa: E402

from gradprobe.adapters.lightning import GradProbeCallback, GradProbeFailedError, step_terms  # noqa: E402
from gradprobe.errors import StepContractError  # noqa: E402

example = load_example("lightning_probe.py")
Regressor = example.Regressor  # the example's module: trunk, head, and a head it never uses


class TwoHeads(Regressor):  # type: ignore[misc, valid-type]
    """The example's module; ``uncertainty_head`` is built but never used (the deliberate bug)."""

    def __init__(self, broken: bool = False) -> None:
        super().__init__(broken)
        self.logged: list[str] = []

    def log(self, name, value, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        self.logged.append(name)  # counts the calls that reach Lightning's logging
        super().log(name, value, *args, **kwargs)


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8
    )


def _trainer(tmp_path, callback, steps: int = 3):  # type: ignore[no-untyped-def]
    return L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )


def test_callback_writes_a_report_naming_the_unused_head(tmp_path) -> None:
    module = TwoHeads()
    callback = GradProbeCallback(report_dir=tmp_path / "gp", print_report=False)
    trainer = _trainer(tmp_path, callback)
    trainer.fit(module, _loader())
    assert trainer.global_step == 3  # the run went on after the probe
    fm = callback.flow_map
    assert fm is not None and fm.terms == ("fit", "smooth")
    # The unused head is named, both in the findings and in every report file.
    unused = [f for f in fm.findings if f.cause == "unused-parameter"]
    assert (
        unused
        and "uncertainty_head.weight" in unused[0].message
        and "uncertainty_head.bias" in unused[0].message
    )
    assert fm.count("eager", "fit only") == (4, 6)  # trunk + head, not uncertainty_head
    assert fm.count("eager", "smooth only") == (2, 6)  # trunk only
    for kind in ("html", "markdown", "json"):
        text = callback.report_paths[kind].read_text(encoding="utf-8")
        assert "uncertainty_head.weight" in text, kind
    assert json.loads(callback.report_paths["json"].read_text())["terms"] == ["fit", "smooth"]
    # The probe's calls of training_step did not log: only the 3 real steps did.
    assert module.logged.count("fit") == 3


def test_callback_compares_the_compiled_form(tmp_path) -> None:
    callback = GradProbeCallback(variants="eager,compile:aot_eager", report_dir=tmp_path, print_report=False)
    _trainer(tmp_path, callback, steps=1).fit(TwoHeads(), _loader())
    fm = callback.flow_map
    assert fm is not None and [v.name for v in fm.variants] == ["eager", "compile:aot_eager"]
    assert fm.count("compile:aot_eager", "all") == fm.count("eager", "all") == (4, 6)
    consistency = fm.checks["consistency"]
    assert consistency, consistency


def test_fail_on_error_stops_the_run(tmp_path) -> None:
    callback = GradProbeCallback(fail_on_error=True, report_dir=tmp_path, print_report=False)
    trainer = _trainer(tmp_path, callback)
    with pytest.raises(GradProbeFailedError, match="nonfinite"):
        trainer.fit(TwoHeads(broken=True), _loader())
    assert trainer.global_step == 0  # stopped before the first optimizer step
    assert callback.report_paths["html"].exists()


def test_probe_leaves_the_module_as_found(tmp_path) -> None:
    module = TwoHeads()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    callback = GradProbeCallback(at_step=0, report_dir=tmp_path, print_report=False)
    callback.on_train_batch_start(_FakeTrainer(tmp_path), module, next(iter(_loader())), 0)
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert all(p.grad is None for p in module.parameters())
    assert "log" not in module.__dict__  # logging un-muted


class _FakeTrainer:
    global_step = 0
    is_global_zero = True

    def __init__(self, root) -> None:  # type: ignore[no-untyped-def]
        self.log_dir = None
        self.default_root_dir = root


def test_step_terms_contract() -> None:
    t = torch.tensor(1.0, requires_grad=True)
    assert list(step_terms(t)) == ["loss"]
    assert list(step_terms({"loss": t, "a": t, "b": t, "n": 3})) == ["a", "b"]
    assert list(step_terms({"loss": t})) == ["loss"]
    assert list(step_terms({"loss": t, "a": t}, ["loss"])) == ["loss"]
    with pytest.raises(StepContractError, match="no 'c'"):
        step_terms({"loss": t}, ["c"])
    with pytest.raises(StepContractError, match="single tensor"):
        step_terms(t, ["a"])
    with pytest.raises(StepContractError, match="list"):
        step_terms([t])


def test_the_example_runs(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr("tempfile.mkdtemp", lambda prefix="": str(tmp_path))
    main = example.main
    assert main([]) == 0
    assert "trained 5 steps" in capsys.readouterr().out
    assert (tmp_path / "gradprobe.html").exists()
    assert main(["--strict"]) == 1  # fail_on_error stops the run with the broken term
