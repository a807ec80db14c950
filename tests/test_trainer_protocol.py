"""The generic trainer protocol, on the plain custom trainer of ``examples/custom_trainer.py``: its
configurations become variants compared value by value, its declared knobs are spelled, parsed and
flipped by the bisector, and a bad adapter gets a clear error."""

from __future__ import annotations

import pytest
import torch
from examples_loader import EXAMPLES, load_example

from gradprobe.build import Built, CompileCounter
from gradprobe.errors import SpecError
from gradprobe.trainer import probe_trainer, trainer_spec, trainer_variants
from gradprobe.variants import parse_variant, register_variant, user_variant

EXAMPLE = EXAMPLES / "custom_trainer.py"


@pytest.fixture(scope="module")
def example():  # type: ignore[no-untyped-def]
    return load_example("custom_trainer.py")


def test_configurations_become_variants(example) -> None:  # type: ignore[no-untyped-def]
    adapter = example.TinyTrainerAdapter(example.TinyTrainer())
    variants = trainer_variants(adapter, knobs={"compiled": {"backend": "eager"}})
    assert [v.name for v in variants] == ["tiny:plain", "tiny:compiled[backend=eager]"]
    assert variants[1].knob("backend") == "eager" and variants[1].knob("detach_aux") is False
    spec = trainer_spec(adapter)
    assert spec.resolved_mode() == "weights" and list(spec.terms) == ["fit", "aux"]
    with pytest.raises(SpecError, match="no configuration 'jit'"):
        trainer_variants(adapter, ["jit"])
    with pytest.raises(SpecError, match="allowed values"):
        trainer_variants(adapter, knobs={"compiled": {"backend": "inductor!"}})


def test_clean_trainer_compiled_matches_plain(example) -> None:  # type: ignore[no-untyped-def]
    adapter = example.TinyTrainerAdapter(example.TinyTrainer())
    before = {k: v.clone() for k, v in adapter.module().state_dict().items()}
    fm = probe_trainer(adapter, knobs={"compiled": {"backend": "eager"}})
    assert fm.reference == "tiny:plain"
    for s in fm.scenario_names:
        assert fm.count("tiny:compiled[backend=eager]", s) == fm.count("tiny:plain", s)
    assert fm.count("tiny:plain", "fit only") == (4, 6) and fm.count("tiny:plain", "aux only") == (4, 6)
    assert fm.checks["consistency"]["variants"]["tiny:compiled[backend=eager]"]["passed"]
    assert not fm.errors()
    assert all(torch.equal(before[k], v) for k, v in adapter.module().state_dict().items())


def test_bisector_flips_the_trainers_own_knob(example) -> None:  # type: ignore[no-untyped-def]
    adapter = example.TinyTrainerAdapter(example.TinyTrainer())
    fm = probe_trainer(adapter, knobs={"compiled": {"detach_aux": True, "backend": "eager"}}, diagnose=True)
    name = "tiny:compiled[detach_aux=true,backend=eager]"
    assert fm.count(name, "aux only") == (2, 6)
    # The trainer returns its total only: its lineage is recorded once per term, and the cut is named
    # with the trainer's own line, in that path only.
    (finding,) = fm.errors()
    assert finding.cause == "graph-break-in-model" and "trunk.weight" in finding.message
    assert finding.location["file"].endswith("custom_trainer.py") and "h.detach()" in finding.location["code"]
    assert finding.location["variants"] == [name]
    bis = fm.bisection(name)
    assert bis is not None and bis["culprit"] == {"knob": "detach_aux", "change": "detach_aux=true → false"}
    assert bis["fix"] == {"variant": "tiny:compiled[backend=eager]", "ok": True}
    assert "verified" in finding.fix


def test_user_variant_knobs_are_spelled_and_parsed() -> None:
    def builder(ctx):  # type: ignore[no-untyped-def]
        assert ctx.knobs == {"level": 2}
        return Built(run=lambda batch, weights: weights["a"] * ctx.model(batch).sum())

    table = {"level": (1, (1, 2)), "fast": (False, (False, True))}
    register_variant("mytrainer", builder, table)
    v = parse_variant("mytrainer[level=2]")
    assert v.name == "mytrainer[level=2]" and v.knobs == {"level": 2} and v.capture == "user"
    assert parse_variant("mytrainer[level=1]").name == "mytrainer"  # defaults are not spelled
    with pytest.raises(SpecError, match="unknown knob 'speed'"):
        parse_variant("mytrainer[speed=1]")
    with pytest.raises(SpecError, match="allowed values"):
        user_variant("x", builder, table, level=3)
    with pytest.raises(SpecError, match="without commas"):
        register_variant("a+b", builder)
    from gradprobe import probe

    model = torch.nn.Linear(3, 1)
    fm = probe(model, lambda m, b, w: w["a"] * m(b).sum(), torch.ones(2, 3), terms=["a"],
               variants=["eager", v])  # fmt: skip
    assert fm.count("mytrainer[level=2]", "a only") == (2, 2)


def test_counter_of_a_built_variant_proves_compiled_runs() -> None:
    """A builder returning ``Built`` with a counter whose executions do not grow is a fallback."""

    class Never:
        graphs = 0
        executions = 0
        fallback_message = "the compiled graph never ran"

    def builder(ctx):  # type: ignore[no-untyped-def]
        return Built(run=lambda batch, weights: weights["a"] * ctx.model(batch).sum(), counter=Never())

    from gradprobe import probe

    fm = probe(torch.nn.Linear(3, 1), lambda m, b, w: w["a"] * m(b).sum(), torch.ones(2, 3), terms=["a"],
               variants=["eager", user_variant("fake-compiled", builder)])  # fmt: skip
    run = fm.run("fake-compiled", "a only")
    assert run.error is not None and run.error.message == "the compiled graph never ran"
    assert isinstance(CompileCounter("eager").executions, int)  # the built-in counter has the same shape


def test_not_an_adapter(example) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SpecError, match="lacks"):
        trainer_variants(object())  # type: ignore[arg-type]
    adapter = example.TinyTrainerAdapter(example.TinyTrainer())
    adapter.configurations = {"plain": {"fast": (False, (False, True))}}
    with pytest.raises(SpecError, match="takes none"):
        trainer_variants(adapter)


def test_gradprobe_run_takes_an_adapter(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from gradprobe.cli import main

    probe_py = tmp_path / "probe.py"
    probe_py.write_text(
        "import runpy\n"
        f"ns = runpy.run_path({str(EXAMPLE)!r})\n"
        "def spec():\n"
        "    return ns['TinyTrainerAdapter'](ns['TinyTrainer']())\n"
    )
    assert (
        main(["run", str(probe_py), "--variants", "compiled[detach_aux=true,backend=eager]", "--diagnose"])
        == 1
    )
    out = capsys.readouterr().out
    assert "tiny:compiled[detach_aux=true,backend=eager]" in out and "detach_aux=true → false" in out
    assert main(["run", str(probe_py), "--variants", "tiny:compiled[backend=eager]"]) == 0
    assert main(["run", str(probe_py), "--variants", "jit"]) == 2
    assert "no configuration 'jit'" in capsys.readouterr().err


def test_a_user_knob_named_backend_can_be_the_culprit() -> None:
    # Regression: the summary took every culprit named "backend" for a rung of the backend ladder
    # and raised KeyError: 'backend' on a trainer's own knob of that name (the DeePMD adapter has one).
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    batch = torch.randn(8, 3)

    def step(m, b):  # type: ignore[no-untyped-def]
        y = m(b)
        return {"fit": y.pow(2).mean(), "reg": m[0].weight.pow(2).sum()}

    def builder(ctx):  # type: ignore[no-untyped-def]
        cut = ctx.knobs["backend"] == "lossy"

        def run(b, w):  # type: ignore[no-untyped-def]
            h = ctx.model[1](ctx.model[0](b))
            y = ctx.model[2](h.detach() if cut else h)
            terms = {"fit": y.pow(2).mean(), "reg": ctx.model[0].weight.pow(2).sum()}
            return w["fit"] * terms["fit"] + w["reg"] * terms["reg"], terms

        return run

    knobs = {"backend": ("lossy", ("lossy", "plain"))}
    variant = user_variant("mine", builder, knobs)
    import gradprobe

    fm = gradprobe.probe(model, step, batch, variants=["eager", variant], diagnose=True)
    bis = fm.bisection("mine")
    assert bis is not None and bis["culprit"] == {"knob": "backend", "change": "backend=lossy → plain"}
    assert bis["fix"] == {"variant": "mine[backend=plain]", "ok": True}
    assert "flipping backend=lossy → plain restores the flow" in bis["summary"]
    assert "backend-drops-grads" not in {f.cause for f in fm.findings}


def test_the_training_check_steps_the_compiled_path_it_names(example) -> None:  # type: ignore[no-untyped-def]
    # build() receives the copy the training check steps: the compiled configuration's terms decrease
    # (built on the trainer's own model, the loss would not depend on the copy and every term would
    # read flat on a healthy model).
    adapter = example.TinyTrainerAdapter(example.TinyTrainer())
    fm = probe_trainer(adapter, knobs={"compiled": {"backend": "eager"}}, checks=["training"])
    verdicts = fm.checks["training"]["verdicts"]
    assert verdicts["tiny:compiled[backend=eager]"] == {"fit": "decreases", "aux": "decreases"}
    assert verdicts["tiny:plain"] == {"fit": "decreases", "aux": "decreases"}
    assert not fm.errors()


def test_a_build_without_model_cannot_be_trained_on_a_copy_and_says_so(example) -> None:  # type: ignore[no-untyped-def]
    class OldStyle(example.TinyTrainerAdapter):  # type: ignore[misc,name-defined]
        def build(self, configuration, knobs):  # type: ignore[no-untyped-def,override]
            step = self.trainer.compiled_loss(knobs.get("backend", "aot_eager"))
            return lambda batch, weights: step(self.trainer.model, batch, weights)

    adapter = OldStyle(example.TinyTrainer())
    fm = probe_trainer(adapter, knobs={"compiled": {"backend": "eager"}}, checks=["training"])
    assert fm.count("tiny:compiled[backend=eager]", "fit only") == (4, 6)  # the probe itself works
    (f,) = [f for f in fm.errors() if f.cause == "check-could-not-run"]
    assert "build() takes no model" in f.message and "build(configuration, knobs, model)" in f.message


def test_the_bisector_tries_the_cheapest_backend_first(example) -> None:  # type: ignore[no-untyped-def]
    # The path compiles with aot_eager and detaches the trunk for aux. The first trial is the cheaper
    # backend (eager): the failure reproduces there, so the trainer's own knob is flipped on eager, and
    # the fix is verified once on aot_eager.
    adapter = example.TinyTrainerAdapter(example.TinyTrainer())
    fm = probe_trainer(adapter, knobs={"compiled": {"detach_aux": True}}, diagnose=True)
    bis = fm.bisection("tiny:compiled[detach_aux=true]")
    assert bis is not None
    assert [(t["knob"], t["variant"], t["ok"]) for t in bis["trials"]] == [
        ("backend", "tiny:compiled[detach_aux=true,backend=eager]", False),
        ("detach_aux", "tiny:compiled[backend=eager]", True),
        ("fix", "tiny:compiled", True),
    ]
    assert bis["culprit"] == {"knob": "detach_aux", "change": "detach_aux=true → false"}
    assert bis["fix"] == {"variant": "tiny:compiled", "ok": True} and bis["irrelevant"] == ["backend"]
