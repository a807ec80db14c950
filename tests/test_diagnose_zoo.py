"""Every known root cause, proved end to end: the zoo injects it, gradprobe names exactly that cause.

The detectors are never told which switch is on: each test builds the spec with one bug and asserts
the exact set of error-severity findings, and where the finding says the problem is.
"""

import os

import pytest

import gradprobe

diagnosed = None


@pytest.fixture(autouse=True)
def _maps(zoo_map):
    global diagnosed
    diagnosed = zoo_map


def errors(fm):
    return sorted(f.cause for f in fm.findings if f.severity == "error")


def finding(fm, cause):
    (f,) = [f for f in fm.findings if f.cause == cause]
    return f


def test_clean_potential_has_no_error_and_reports_the_unused_head():
    fm = diagnosed(variants="eager,make_fx[detach=alias]+compile:aot_eager")
    assert errors(fm) == []
    info = finding(fm, "unused-parameter")
    assert info.severity == "info" and info.location == {"modules": ["aux_head"]}
    assert fm.bisections == () and fm.breaks == ()
    assert fm.exit_code == 0


def test_trace_eval_mode():
    fm = diagnosed("trace-eval-mode")
    assert errors(fm) == ["trace-eval-mode"]
    f = finding(fm, "trace-eval-mode")
    assert f.location["module_type"] == "ReferencePotential" and "torch.autograd.grad(" in f.location["code"]
    assert os.path.basename(f.location["file"]) == "potential.py"
    (b,) = fm.bisections
    assert b["culprit"]["knob"] == "mode" and b["culprit"]["change"] == "mode=eval → train"
    assert b["fix"] == {"variant": "eager[mode=train]", "ok": True}


def test_makefx_detach_names_nodes_lines_and_the_knob():
    fm = diagnosed("makefx-detach")
    assert errors(fm) == ["makefx-detach"]
    f = finding(fm, "makefx-detach")
    # Located by the lineage of the replayed graph, root first: the first detach node of the chain, on
    # the descriptor's saved tanh output (the gradients check finds the descriptor's parameters reached
    # with wrong values there), with the node name; the fitting net's nodes follow it.
    assert f.location["node"].startswith("detach") and f.location["kind"] == "detach"
    assert os.path.basename(f.location["file"]) == "potential.py" and "self.embed1" in f.location["code"]
    assert f.evidence["graph"]["cutting_detach_nodes"] > 0  # the lint of the handed-over graph sharpens it
    assert set(f.evidence["lost"]) == {"fitting.layer1.bias", "fitting.layer2.bias"}
    assert "#175477" in f.message
    (b,) = fm.bisections
    assert b["stage"] == "make_fx" and b["culprit"]["knob"] == "detach"
    assert "mode" in b["irrelevant"]
    assert b["fix"]["ok"] and b["fix"]["variant"] == "make_fx[detach=alias]+compile:aot_eager"
    # The backend is never blamed for what flipping detach handling fixes.
    assert not any(t["knob"] == "backend" for t in b["trials"])
    assert "the compile backend does not matter" in f.message


def test_double_backward_unsupported():
    fm = diagnosed("double-backward-unsupported")
    assert errors(fm) == ["double-backward-unsupported"]
    f = finding(fm, "double-backward-unsupported")
    assert f.location["variant"] == "compile:aot_eager" and f.location["backend"] == "aot_eager"
    # the create_graph call whose compiled backward is differentiated again (anomaly mode's trace)
    assert f.location["file"].endswith("zoo/potential.py") and "create_graph" in f.location["code"]
    assert "make_fx[detach=alias]+compile:aot_eager matches eager" in f.fix
    assert "trace_autograd_ops" in f.fix and "torch.func.grad" in f.fix


def test_backend_drops_grads():
    fm = diagnosed("backend-drops-grads")
    assert errors(fm) == ["backend-drops-grads"]
    f = finding(fm, "backend-drops-grads")
    assert f.location["backend"] == "zoo_lossy"
    assert f.evidence["parameters"] == ["fitting.layer2.weight"]
    (b,) = fm.bisections
    assert b["stage"] == "compile" and b["culprit"]["last_good"] == "aot_eager_decomp_partition"


def test_requires_grad_placement():
    fm = diagnosed("requires-grad-placement")
    assert errors(fm) == ["requires-grad-placement"]
    f = finding(fm, "requires-grad-placement")
    assert f.location["kind"] == "autograd_grad_unused_input" and "torch.autograd.grad(" in f.location["code"]


def test_graph_break_in_model():
    fm = diagnosed("graph-break-in-model")
    assert errors(fm) == ["graph-break-in-model"]
    f = finding(fm, "graph-break-in-model")
    assert (f.location["module"], f.location["code"]) == ("descriptor", "g = g.detach()")
    # Cut from the descriptor's first layer; the type embedding, which also feeds the fitting net
    # directly, stays reached with a wrong value (the gradients check's finite differences).
    assert set(f.evidence["parameters"]) == {
        "descriptor.embed1.bias", "descriptor.embed1.weight", "type_embedding.weight",
    }  # fmt: skip
    assert f.evidence["statuses"]["type_embedding.weight"] == "wrong"
    assert f.evidence["terms"] == ["energy", "force", "virial"] and f.location["kind"] == "detach"
    # The auxiliary head stays an info finding: nothing cuts it, it is simply not used.
    assert finding(fm, "unused-parameter").evidence["parameters"] == ["aux_head.weight", "aux_head.bias"]


def test_recompile_per_scenario():
    fm = diagnosed("recompile-per-scenario")
    assert errors(fm) == ["recompile-per-scenario"]
    f = finding(fm, "recompile-per-scenario")
    # Named from dynamo's own guard-failure reason, with the user's line.
    assert (
        f.location["variant"] == "compile:aot_eager"
        and os.path.basename(f.location["file"]) == "multitask.py"
    )
    assert "bool(weights" in f.location["code"] and f.evidence["guards"]
    assert fm.variant("compile:aot_eager").compile_count == 4


def test_nonfinite_grad_names_the_op():
    fm = diagnosed("nonfinite-grad")
    assert errors(fm) == ["nonfinite-grad"]
    f = finding(fm, "nonfinite-grad")
    assert f.location["op"] == "SqrtBackward0" and "torch.sqrt(r2)" in f.location["code"]


def test_diagnosis_never_looks_at_the_switch():
    # The same evidence without the zoo: a flow map read back from JSON diagnoses the same.
    from gradprobe.diagnose import diagnose

    fm = diagnosed("graph-break-in-model")
    back = gradprobe.FlowMap.from_json(fm.to_json())
    assert [f.cause for f in diagnose(back)] == [f.cause for f in fm.findings]


@pytest.mark.parametrize("bug", ["trace-eval-mode", "graph-break-in-model"])
def test_demo_bug_cli(bug, capsys):
    from gradprobe.cli import main

    assert main(["demo", "--bug", bug]) == 1
    out = capsys.readouterr().out
    assert out.startswith("gradprobe: PROBLEM: 1 error(s)") and f"ERROR {bug}:" in out
