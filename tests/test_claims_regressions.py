"""Issue 32, "Say only what was measured": the false statements seen, each on a model written here.

Every test also audits the map: each finding of the compile and failure causes carries claims, and
each claim holds on the map's own evidence (``gradprobe.claims.audit``).

* advice a trial refuted (``backend='eager'`` for a double backward whose eager-backend path drops
  every force gradient) is never suggested;
* a ``detach=alias`` trial that also removes the step's own ``detach()`` is not "verified";
* a recompile explained by the guard dynamo recorded, never as "Python numbers" when the guard is on
  something else, and runs without compiled code said to be so when dynamo recorded no reason;
* a check that failed for a reason other than copying gets no deep-copy advice;
* every failure signature's finding rests on claims that hold.
"""

from __future__ import annotations

import functools
import itertools
import os

import msgspec
import torch
from torch import nn

import gradprobe
from gradprobe.build import Built, CompileCounter
from gradprobe.claims import audit, holds
from gradprobe.diagnose import diagnose
from gradprobe.flowmap import RunError
from gradprobe.report.html import render_html
from gradprobe.report.markdown import render_markdown
from gradprobe.variants import user_variant

MINE = {
    "double-backward-unsupported", "recompile-per-scenario", "donated-buffers", "create-graph-tangent-strides",
    "data-dependent-trace", "dynamo-internal-error", "dynamo-disabled", "backend-drops-grads", "makefx-detach",
    "frozen-trace", "shape-locked", "trace-eval-mode", "requires-grad-placement", "run-failed",
    "check-could-not-run", "forces-not-conservative", "outputs-differ", "term-not-decreasing",
}  # fmt: skip
HERE = os.path.basename(__file__)


def mine(fm: gradprobe.FlowMap) -> list[str]:
    """What is wrong with the claims of the compile and failure causes' findings."""
    return [p for p in audit(fm) if p.split(":")[0] in MINE]


def listing(fm: gradprobe.FlowMap) -> str:
    return "\n".join(f"  {f.severity} {f.cause}: {f.message}\n    fix: {f.fix}" for f in fm.findings)


def the(fm: gradprobe.FlowMap, cause: str) -> gradprobe.Finding:
    (f,) = [f for f in fm.findings if f.cause == cause]
    return f


# ----- a small potential: energy from pair distances, forces -dE/dx ---------------------------------------


class Pairs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(1, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        d = (pos[:, None, :] - pos[None, :, :]).pow(2).sum(-1).add(1.0).sqrt()
        return self.out(torch.tanh(self.embed(d[..., None]))).sum()


BATCH = {"pos": torch.randn(5, 3, generator=torch.Generator().manual_seed(1)), "f": torch.zeros(5, 3)}


def pair_terms(model: nn.Module, b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    pos = b["pos"].clone().requires_grad_(True)
    e = model(pos)
    f = -torch.autograd.grad(e, pos, create_graph=True)[0]
    return {"energy": e.pow(2), "force": (f - b["f"]).pow(2).mean()}


# ----- 1. double backward: a backend the probe measured dropping the forces is never suggested --------


def _compiled_forces(ctx):  # type: ignore[no-untyped-def]
    """The model compiled with the path's ``backend`` knob, forces by autograd with create_graph.

    A stand-in for a package whose ``torch.compile(model, backend="eager")`` returns forces with no
    gradient path (torchmd-net 3.1 does, DESIGN's third-round facts; plain torch 2.13 does not, so
    the stand-in reproduces it: with the eager backend — the knob, or a backend override of the
    bisection, read the way torch.compile reads it — the forces come back detached)."""
    from torch._inductor.compiler_bisector import CompilerBisector

    chosen = ctx.knobs.get("backend", "aot_eager")
    backend = CompilerBisector.get_backend() or chosen
    compiled = torch.compile(ctx.model, backend=chosen)

    def run(batch, weights):  # type: ignore[no-untyped-def]
        pos = batch["pos"].clone().requires_grad_(True)
        e = compiled(pos)
        f = -torch.autograd.grad(e, pos, create_graph=True)[0]
        if backend == "eager":
            f = f.detach()  # what the package's eager-backend compile hands back
        terms = {"energy": e.pow(2), "force": (f - batch["f"]).pow(2).mean()}
        return weights["energy"] * terms["energy"] + weights["force"] * terms["force"], terms

    return run


BACKEND = {"backend": ("aot_eager", ("aot_eager", "eager"))}


def test_double_backward_never_suggests_the_backend_its_own_trial_refuted() -> None:
    variants = [
        "eager",
        user_variant("pot", _compiled_forces, BACKEND),
        user_variant("pot", _compiled_forces, BACKEND, backend="eager"),
    ]
    fm = gradprobe.probe(Pairs(), pair_terms, BATCH, variants=variants, diagnose=True, progress=False)
    # What was measured: with aot_eager the forces raise the double backward; with the eager backend
    # the probe measured the force term reaching nothing.
    assert "double backward" in fm.run("pot", "force only").error.message
    assert fm.run("pot[backend=eager]", "force only").error.type == "NoGradPath"
    f = the(fm, "double-backward-unsupported")
    assert "backend='eager'" not in f.fix, f.fix  # refuted here: never suggested
    refuting = [c for c in f.claims if c.kind == "trial" and c.args["ok"] is False]
    assert refuting and all(holds(fm, c) for c in refuting)
    assert "refuted here, not suggested" in f.fix and "→ eager" in f.fix
    assert "(not tried)" in f.fix  # the patterns nothing here tried say so
    assert "verified" not in f.fix
    assert mine(fm) == [], listing(fm)


# ----- 2. make_fx detach: an alias over the step's own detach() is not "verified" ---------------------


class Probed(nn.Module):
    """A potential with a linear probe on detached features: the probe's loss must not train the trunk
    (an intended ``detach()``), while forces are second-order terms make_fx's detach nodes break."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(3, 8)
        self.hidden = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.probe = nn.Linear(8, 1)

    def forward(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.trunk(pos))
        e = self.head(torch.tanh(self.hidden(h))).sum()
        return e, self.probe(h.detach()).sum()  # the probe sees the features, never trains them


def probed_terms(model: nn.Module, b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    pos = b["pos"].clone().requires_grad_(True)
    e, p = model(pos)
    f = -torch.autograd.grad(e, pos, create_graph=True)[0]
    return {"energy": e.pow(2), "force": (f - b["f"]).pow(2).mean(), "probe": (p - 1.0).pow(2)}


@functools.cache
def probed() -> gradprobe.FlowMap:
    return gradprobe.probe(
        Probed(), probed_terms, BATCH, variants="eager,make_fx", diagnose=True, progress=False
    )


def test_an_alias_over_the_steps_own_detach_is_not_verified() -> None:
    fm = probed()
    assert fm.differences("make_fx", "force only")  # make_fx's detach nodes break the forces
    b = fm.bisection("make_fx")
    assert b is not None
    alias = [t for t in b["trials"] if "detach=alias" in t["variant"]]
    assert alias and not any(t["ok"] for t in alias), b["trials"]
    # The alias trial gives the probe's loss gradients the reference does not have: measured, said.
    assert any("extra" in t["result"] and "probe only" in t["result"] for t in alias), alias
    assert "fix verified" not in b["summary"]
    if b["fix"] is not None and not b["fix"]["ok"]:
        assert "does not match" in b["summary"]
    for f in fm.findings:
        assert not ("verified" in f.fix and "detach=alias" in f.fix), listing(fm)
        assert "fix verified: make_fx[detach=alias]" not in f.message, listing(fm)
    f = the(fm, "makefx-detach")
    assert "tried: detach=keep → alias" in f.fix and "refuted here" in f.fix
    assert mine(fm) == [], listing(fm)


# ----- 3. recompile-per-scenario: the guard as dynamo recorded it --------------------------------------


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # a counter on the model: dynamo guards on its value
        return self.lin(x) * (1.0 + 0.0 * self.calls)


XY = {"x": torch.randn(8, 4, generator=torch.Generator().manual_seed(2)), "y": torch.zeros(8, 4)}


def fit_terms(model: nn.Module, b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    h = model(b["x"])
    return {"fit": (h - b["y"]).pow(2).mean(), "reg": h.abs().mean()}


def _no_number_story(f: gradprobe.Finding) -> None:
    text = f"{f.message} {f.fix}"
    assert "Python number" not in text and "0-dim" not in text, text


def test_a_guard_on_a_models_counter_is_named_not_explained_as_numbers() -> None:
    fm = gradprobe.probe(Counting(), fit_terms, XY, variants="eager,compile:aot_eager", progress=False)
    f = the(fm, "recompile-per-scenario")
    _no_number_story(f)
    assert "model.calls ==" in f.message and "cause not known beyond the guard" in f.message
    assert os.path.basename(f.location["file"]) == HERE and "self.calls += 1" in f.location["code"]
    guards = [c for c in f.claims if c.kind == "guard_at"]
    assert guards and all(holds(fm, c) for c in guards)
    assert mine(fm) == [], listing(fm)


class Wrapped:
    """A batch object whose method is re-created on every call (a lambda over a per-call value)."""

    calls = itertools.count()

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        n = next(self.calls)
        self.x, self.y = x, y
        self.scale = lambda t: t * (2.0 + 0.0 * n)


def _wrapping(ctx):  # type: ignore[no-untyped-def]
    model = ctx.model

    def loss(obj, w):  # type: ignore[no-untyped-def]
        h = obj.scale(model(obj.x))
        return w["fit"] * (h - obj.y).pow(2).mean() + w["reg"] * h.abs().mean()

    compiled = torch.compile(loss, backend="aot_eager")
    return lambda batch, weights: compiled(Wrapped(batch["x"], batch["y"]), weights)


def twice_terms(model: nn.Module, b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    h = model(b["x"]) * 2.0
    return {"fit": (h - b["y"]).pow(2).mean(), "reg": h.abs().mean()}


def test_a_guard_on_a_batch_objects_lambda_is_named_not_explained_as_numbers() -> None:
    model = nn.Linear(4, 4)
    fm = gradprobe.probe(
        model, twice_terms, XY, variants=["eager", user_variant("wrap", _wrapping)], progress=False
    )
    f = the(fm, "recompile-per-scenario")
    _no_number_story(f)
    assert "obj.scale" in f.message and "cause not known beyond the guard" in f.message
    assert mine(fm) == [], listing(fm)


def _train_only(ctx):  # type: ignore[no-untyped-def]
    """A wrapper that runs its compiled module in train mode only (DeePMD 3.2's ``_CompiledModel``
    does this): with the model in eval mode nothing compiled runs."""
    counter = CompileCounter("aot_eager")
    compiled = torch.compile(ctx.model, backend=counter)

    def run(batch, weights):  # type: ignore[no-untyped-def]
        module = compiled if ctx.model.training else ctx.model
        h = module(batch["x"])
        return weights["fit"] * (h - batch["y"]).pow(2).mean() + weights["reg"] * h.abs().mean()

    return Built(run=run, counter=counter)


def test_a_path_that_ran_no_compiled_code_is_said_to_and_not_explained() -> None:
    model = nn.Linear(4, 4).eval()
    fm = gradprobe.probe(model, fit_terms, XY, variants=["eager", user_variant("trainonly", _train_only)],
                         progress=False)  # fmt: skip
    assert not model.training  # left as found
    f = the(fm, "recompile-per-scenario")
    _no_number_story(f)
    assert "ran no compiled code" in f.message
    assert "dynamo recorded no recompile reason" in f.message and "cause not known" in f.message
    assert {c.kind for c in f.claims} >= {"ran_eager", "no_recompile_reason"}
    assert mine(fm) == [], listing(fm)


# ----- 4. check-could-not-run: the recorded error, not deep-copy advice -------------------------------


def test_a_check_that_failed_running_the_step_gets_its_error_not_copy_advice() -> None:
    calls = itertools.count()

    def step(m, b):  # type: ignore[no-untyped-def]
        if next(calls) >= 8:  # the data runs out after a few calls: the training check's later steps fail
            raise RuntimeError("the batch iterator is exhausted")
        return fit_terms(m, b)

    fm = gradprobe.probe(nn.Linear(4, 4), step, XY, checks=["training"], progress=False)
    (f,) = [f for f in fm.findings if f.cause == "check-could-not-run"]
    assert "the batch iterator is exhausted" in f.message and "training (eager)" in f.message
    assert f"{HERE}:" in f.message  # the frame the failure came from
    assert "cop" not in f.fix.lower(), f.fix  # no deep-copy advice for a failure that is not a copy
    assert {c.kind for c in f.claims} >= {"check_error", "check_where"}
    assert mine(fm) == [], listing(fm)


# ----- 5. every failure signature's finding rests on claims that hold --------------------------------


class Affine(nn.Module):
    # Not an nn.Linear at the top: on torch 2.13 a compile of nn.Linear with a plain backward makes a later
    # test's compiled model that calls nn.Linear raise "donated buffers" on its create_graph backward.
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.eye(4) + 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


def test_failure_signatures_state_what_was_recorded() -> None:
    fm = gradprobe.probe(Affine(), fit_terms, XY, variants="eager,compile_model:aot_eager", progress=False)
    v = "compile_model:aot_eager"
    where = {"file": __file__, "line": 7, "code": "f = -torch.autograd.grad(e, x, create_graph=True)[0]"}
    errors = {
        "create-graph-tangent-strides": RunError(
            "backward", "RuntimeError",
            "a leaf Variable that requires grad is being used in an in-place operation.", where,
            ("runtime_wrappers.py:2489 in coerce_to_expected_memory_format",),
        ),
        "donated-buffers": RunError(
            "backward", "RuntimeError", "This backward function was compiled with non-empty donated buffers "
            "which requires create_graph=False and retain_graph=False.", where,
        ),
        "data-dependent-trace": RunError(
            "compile", "GuardOnDataDependentSymNode", "Could not guard on data-dependent expression u0 > 1",
            where,
        ),
        "run-failed": RunError("forward", "ValueError", "something only this path does", where),
    }  # fmt: skip
    for cause, err in errors.items():
        runs = tuple(msgspec.structs.replace(r, error=err) if r.variant == v else r for r in fm.runs)
        cells = tuple(c for c in fm.cells if c.variant != v)
        broken = msgspec.structs.replace(fm, runs=runs, cells=cells)
        found = msgspec.structs.replace(broken, findings=tuple(diagnose(broken)))
        f = the(found, cause)
        assert f.claims and mine(found) == [], listing(found)
        assert any(c.kind in ("failed_at", "build_failed_at") for c in f.claims), f.claims
        if cause != "run-failed":
            assert "not tried" in f.fix or "not measured" in f.fix, f.fix


# ----- the trial table in every report ----------------------------------------------------------------


def test_the_trial_table_is_printed_from_the_map() -> None:
    fm = probed()
    b = fm.bisection("make_fx")
    assert b is not None and b["trials"]
    flip = b["trials"][0]["change"]
    text = gradprobe.render(fm)
    assert "bisect make_fx" in text and flip in text and "seconds" in text
    md = render_markdown(fm)
    assert "| flip | result | seconds |" in md and "Bisection of make_fx" in md
    html = render_html(fm)
    assert "Bisection trials" in html and "<th>flip</th><th>result</th><th>seconds</th>" in html


def test_dynamo_off_and_differing_outputs_state_what_was_recorded() -> None:
    fm = gradprobe.probe(Affine(), fit_terms, XY, variants="eager,compile_model:aot_eager", progress=False)
    v = "compile_model:aot_eager"
    # dynamo switched off for the process: every compiled run ran eager (as recorded).
    fell = RunError("compile", "DynamoFallback", "no compiled graph ran")
    runs = tuple(msgspec.structs.replace(r, error=fell) if r.variant == v else r for r in fm.runs)
    off = msgspec.structs.replace(
        fm, runs=runs, cells=tuple(c for c in fm.cells if c.variant != v),
        evidence={**fm.evidence, "environment": {"dynamo_disabled": {"env": "1"}}},
    )  # fmt: skip
    off = msgspec.structs.replace(off, findings=tuple(diagnose(off)))
    assert the(off, "dynamo-disabled").claims and mine(off) == [], listing(off)
    # a path checked on its own outputs: its physics is right, its forces differ from the reference's.
    physics = {"passed": False, "outputs": {"force": 0.2, "energy": 0.0},
               "failures": ["force differs from the reference path's by 0.2 of its scale"]}  # fmt: skip
    differ = msgspec.structs.replace(fm, checks={**fm.checks, "physics_paths": {v: physics}})
    differ = msgspec.structs.replace(differ, findings=tuple(diagnose(differ)))
    f = the(differ, "outputs-differ")
    assert {c.kind for c in f.claims} >= {"outputs", "physics"} and mine(differ) == [], listing(differ)


# ----- cuts: the root, not the intended detach beside it; the remedy of the construct recorded ------------


def _claims_case(case_id: str):  # type: ignore[no-untyped-def]
    from claims import entries

    (entry,) = [e for e in entries() if e.id == case_id]
    model, step, batch, kwargs = entry.make()
    fm = gradprobe.probe(model, step, batch, diagnose=True, progress=False, **kwargs)
    return entry, fm


def test_a_value_through_item_is_the_one_error_not_the_intended_detach_beside_it() -> None:
    """Only the value term moves with the critic through ``.item()``: the policy and entropy terms
    are not blamed for it, and the intended ``advantage.detach()`` stays a question (a warning) that
    names the root, though nothing else trains the critic while the root is there."""
    entry, fm = _claims_case("a2c-value-through-item")
    (error,) = fm.errors()
    assert error.cause == "graph-break-in-model" and error.location["line"] == entry.root_line, listing(fm)
    assert error.message.startswith("critic: "), error.message
    assert error.fix.startswith("keep the value a tensor"), error.fix
    (warning,) = [f for f in fm.findings if f.cause == "stop-gradient"]
    assert warning.location["line"] in entry.stop_lines
    assert f"cut on its own at actor_critic.py:{entry.root_line} (.item())" in warning.message, (
        warning.message
    )
    assert audit(fm) == []


def test_a_penalty_without_create_graph_is_told_to_take_it() -> None:
    entry, fm = _claims_case("wgan-gp-no-create-graph")
    (error,) = fm.errors()
    assert (
        error.location["line"] == entry.root_line
        and error.location["kind"] == "autograd_grad_no_create_graph"
    )
    assert "pass create_graph=True to that torch.autograd.grad call" in error.fix, error.fix
    assert "remove the torch.autograd.grad" not in error.fix and ".item()" not in error.fix
    assert audit(fm) == []


class StraightThroughVQ(nn.Module):
    """An encoder, a codebook picked by nearest neighbour, and a decoder fed through the straight-through
    estimator ``z + (e - z).detach()``; returns (z, e, decoded)."""

    def __init__(self, features: int, width: int, codes: int) -> None:
        super().__init__()
        self.enc = nn.Linear(features, width)
        self.codes = nn.Parameter(torch.randn(codes, width))
        self.dec = nn.Linear(width, features)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        z = self.enc(x)
        e = self.codes[torch.cdist(z, self.codes).argmin(-1)]
        return z, e, self.dec(z + (e - z).detach())  # straight-through


def test_parameters_reached_with_wrong_values_are_not_counted_as_unreached() -> None:
    """A straight-through estimator's detach is the route to the codebook; when no other term trains
    the codebook, the encoder is still reached by the term, only with a gradient off its finite
    differences: the message says which parameters are which."""

    torch.manual_seed(3)
    fm = gradprobe.probe(
        StraightThroughVQ(6, 3, 7).double(), lambda m, x: {"recon": (m(x)[2] - x).pow(2).mean()},
        torch.randn(10, 6).double(),
        diagnose=True, progress=False,
    )  # fmt: skip
    (error,) = fm.errors()
    assert "no gradient: codes" in error.message, error.message
    assert "a gradient off its finite differences: enc.weight, enc.bias" in error.message, error.message
    assert "does not reach or gets wrong" in error.message
    assert audit(fm) == []


def test_a_traced_path_recording_the_users_own_detach_is_the_same_cut_not_only_in_make_fx() -> None:
    """make_fx records the step's own straight-through ``detach()`` as a graph node at the same line:
    one warning for the line, seen in every path, never a second one saying "only in make_fx"."""

    def vq_losses(m: StraightThroughVQ, x: torch.Tensor) -> dict[str, torch.Tensor]:
        z, e, out = m(x)
        return {"recon": (out - x).pow(2).mean(), "codebook": (e - z.detach()).pow(2).mean(),
                "commit": (z - e.detach()).pow(2).mean()}  # fmt: skip

    torch.manual_seed(4)
    fm = gradprobe.probe(StraightThroughVQ(5, 2, 6), vq_losses, torch.randn(9, 5), variants="eager,make_fx", diagnose=True,
                         checks=["gradients"],
                         progress=False)  # fmt: skip
    warnings = [f for f in fm.findings if f.cause == "stop-gradient"]
    lines = [f.location["line"] for f in warnings]
    assert len(lines) == len(set(lines)) == 3, listing(fm)
    assert all("only in" not in f.message and "every path" in f.message for f in warnings), listing(fm)
    assert not fm.errors() and audit(fm) == []


def test_a_term_detached_whole_is_the_root_not_the_intended_detaches_beside_it() -> None:
    """The codebook term detaches both sides: it trains nothing, and nothing else trains the codebook.
    The straight-through and commitment detaches cut the codebook too, on purpose: they stay questions
    (warnings) that name the root; the one error is at the term that was left with nothing."""
    entry, fm = _claims_case("vq-codebook-term-detached")
    (error,) = fm.errors()
    assert error.location["line"] == entry.root_line and error.message.startswith("codebook: "), listing(fm)
    warnings = [f for f in fm.findings if f.cause == "stop-gradient"]
    lines = {f.location["line"] for f in warnings}
    assert len(warnings) == len(lines) == 2 and lines <= set(entry.stop_lines), listing(fm)
    assert all(
        f"cut on its own at vector_quantised.py:{entry.root_line} (detach())" in f.message for f in warnings
    )
    assert audit(fm) == []


def test_every_route_cut_by_an_intended_looking_detach_is_one_finding() -> None:
    """A VQ-VAE whose codebook term detaches the wrong side: each of three explicit detaches cuts the
    codebook from its term, none is a root the others could be told apart from, and nothing trains the
    codebook. One error lists the routes; not three errors, one per detach."""

    def swapped(m: StraightThroughVQ, x: torch.Tensor) -> dict[str, torch.Tensor]:
        z, e, out = m(x)
        codebook = (e.detach() - z).pow(2).mean()  # the bug: the detach belongs on z
        commit = (z - e.detach()).pow(2).mean()
        return {"recon": (out - x).pow(2).mean(), "codebook": codebook, "commit": commit}

    torch.manual_seed(2)
    fm = gradprobe.probe(
        StraightThroughVQ(6, 2, 5).double(),
        swapped,
        torch.randn(10, 6).double(),
        diagnose=True,
        progress=False,
    )
    (error,) = fm.errors()
    assert error.cause == "graph-break-in-model" and error.message.startswith("codes: trained by no term"), (
        listing(fm)
    )
    for term in ("recon", "codebook", "commit"):
        assert f"{term} at {HERE}:" in error.message, error.message
    assert not [f for f in fm.findings if f.cause == "stop-gradient"]
    assert audit(fm) == []
