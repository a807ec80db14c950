"""Ground truth by construction: random models whose gradient flow is known without running autograd.

Hypothesis draws a small model: modules (``Linear`` + ``tanh`` blocks, some parameters frozen, some
modules used twice, some never) applied at nodes of a tree over one shared input ``x``, each node
reading ``x`` or an earlier node's output through an edge that passes it on, multiplies it by an exact
zero, or cuts it (``detach``, ``torch.no_grad``, an integer cast ``.long()``, ``.item()`` back through
``torch.tensor``). Loss terms sum a subset of node outputs with coefficients 1, 0, 1e-200 or 1e200, or are
second-order (the squared norm of ``autograd.grad(node.sum(), x, create_graph=True)``). The model and
its step are generated as source code, one line per cut, so the locator's answer can be checked line by
line.

For each term the status of every parameter (``none`` / ``zero`` / ``nonzero``) follows from the
construction alone (``expected_flow``); gradprobe's flow map must equal it in eager terms mode and in
weights mode, and ``locate_breaks`` must name every cut that severs a gradient, by kind and source line.

The default example count keeps the suite fast; ``GRADPROBE_HYPOTHESIS_EXAMPLES=2000`` for a nightly run.
"""

from __future__ import annotations

import itertools
import linecache
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import hypothesis
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn

import gradprobe
import gradprobe.measure
import gradprobe.status
from gradprobe.evidence.locate import locate_breaks

EXAMPLES = int(os.environ.get("GRADPROBE_HYPOTHESIS_EXAMPLES", "25"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,  # no .hypothesis/ folder in the checkout; failures print their example
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)

WIDTH, ROWS = 3, 4
PASS, ZERO_MULT = "pass", "zero"
CUT_KINDS = ("detach", "no_grad", "int_cast", "item")  # edge name = the locator's kind
EDGES = (PASS, ZERO_MULT, *CUT_KINDS)
COEFFICIENTS = (1.0, 0.0, 1e-200, 1e200)  # 1e-200: squares to 0 in float64 (an L2 status would lie)

# Flow of one gradient: no autograd path (None), a path whose value is exactly zero, or non-zero.
NONE, ZERO, NONZERO = "none", "zero", "nonzero"
_RANK = {NONE: 0, ZERO: 1, NONZERO: 2}


def combine(*flows: str) -> str:
    """The flow of a sum: None + g = g, 0 + 0 = 0, anything + non-zero = non-zero (no exact cancellation:
    every coefficient is positive and the weights are random)."""
    return max(flows, key=_RANK.__getitem__, default=NONE)


# ---------------------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class Node:
    module: int  # index of the Linear applied here (two nodes may share one: a shared parameter)
    src: int  # -1: the input x; else an earlier node
    edge: str  # how the source reaches this node: pass, zero, or one of the cuts


@dataclass(frozen=True)
class Term:
    name: str
    parts: tuple[tuple[int, float], ...] = ()  # first order: sum of coefficient * node.sum()
    second: tuple[int, float] | None = None  # second order: coefficient * |d node.sum() / dx|^2


@dataclass(frozen=True)
class Config:
    frozen: tuple[tuple[bool, bool], ...]  # per module: (weight frozen, bias frozen)
    nodes: tuple[Node, ...]
    terms: tuple[Term, ...]
    x_requires_grad: bool
    seed: int

    def params(self) -> list[tuple[str, int, bool]]:
        """(name, module index, trainable) in ``named_parameters()`` order."""
        return [
            (f"m{m}.{kind}", m, not frozen[k])
            for m, frozen in enumerate(self.frozen)
            for k, kind in enumerate(("weight", "bias"))
        ]


def _uncut_path(nodes: tuple[Node, ...], k: int) -> bool:
    """Node k is joined to x by pass/zero edges only (x's gradient exists for a second-order term)."""
    while k >= 0:
        if nodes[k].edge in CUT_KINDS:
            return False
        k = nodes[k].src
    return True


@st.composite
def configs(draw: st.DrawFn) -> Config:
    n_modules = draw(st.integers(1, 4))
    frozen = tuple((draw(st.integers(0, 3)) == 3, draw(st.integers(0, 3)) == 3) for _ in range(n_modules))
    if all(all(f) for f in frozen):  # gradprobe refuses a model without trainable parameters
        frozen = ((frozen[0][0], False), *frozen[1:])
    nodes: list[Node] = []
    for i in range(draw(st.integers(1, 6))):
        nodes.append(
            Node(
                draw(st.integers(0, n_modules - 1)),
                draw(st.integers(-1, i - 1)),
                draw(st.sampled_from(EDGES)),
            )
        )
    node_t = tuple(nodes)
    reachable = [k for k in range(len(node_t)) if _uncut_path(node_t, k)]
    terms = []
    for t in range(draw(st.integers(1, 3))):
        coefficient = draw(st.sampled_from(COEFFICIENTS))
        if reachable and draw(st.booleans()):
            terms.append(Term(f"t{t}", second=(draw(st.sampled_from(reachable)), coefficient)))
        else:
            picked = draw(st.lists(st.integers(0, len(node_t) - 1), min_size=1, max_size=3, unique=True))
            parts = [
                (k, coefficient if j == 0 else draw(st.sampled_from(COEFFICIENTS)))
                for j, k in enumerate(picked)
            ]
            terms.append(Term(f"t{t}", parts=tuple(parts)))
    second = any(t.second is not None for t in terms)
    return Config(frozen, node_t, tuple(terms), second or draw(st.booleans()), draw(st.integers(0, 2**16)))


# ---------------------------------------------------------------------------- the model as source code
_EDGE_CODE = {
    PASS: "t = {src}",
    ZERO_MULT: "t = {src} * 0.0",
    "detach": "t = {src}.detach()",
    "no_grad": "with torch.no_grad(): t = {src} * 1.0",
    # tanh + 2 lies in (1, 3): the cast gives 1 or 2, never a zero input
    "int_cast": "t = ({src}.tanh() + 2).long().double()",
    "item": "t = torch.tensor({src}.abs().mean().item() + 0.5, dtype=torch.float64)"
    + f".expand({ROWS}, {WIDTH})",
}


@dataclass
class Generated:
    model: nn.Module
    step: Callable[..., Any]
    weights_step: Callable[..., Any]
    batch: dict[str, torch.Tensor]
    file: str
    edge_lines: list[int]  # per node: the line of its edge


_counter = itertools.count()


def generate(cfg: Config) -> Generated:
    """Write the model and its steps as Python source (registered with linecache), and build them."""
    lines = [
        "import torch",
        "from torch import nn",
        "",
        "class Model(nn.Module):",
        "    def __init__(self):",
        "        super().__init__()",
    ]
    for m, (w_frozen, b_frozen) in enumerate(cfg.frozen):
        lines.append(f"        self.m{m} = nn.Linear({WIDTH}, {WIDTH}, dtype=torch.float64)")
        if w_frozen:
            lines.append(f"        self.m{m}.weight.requires_grad_(False)")
        if b_frozen:
            lines.append(f"        self.m{m}.bias.requires_grad_(False)")
    lines += ["", "    def forward(self, x):", "        h = []"]
    edge_lines = []
    for node in cfg.nodes:
        src = "x" if node.src < 0 else f"h[{node.src}]"
        lines.append("        " + _EDGE_CODE[node.edge].format(src=src))
        edge_lines.append(len(lines))
        lines.append(f"        h.append(torch.tanh(self.m{node.module}(t)))")
    lines += ["        return h", "", "def step(model, batch):", '    x = batch["x"]', "    h = model(x)"]
    lines.append("    terms = {}")
    for term in cfg.terms:
        if term.second is not None:
            k, c = term.second
            expr = f"{c!r} * torch.autograd.grad(h[{k}].sum(), x, create_graph=True)[0].pow(2).sum()"
        else:
            expr = " + ".join(f"{c!r} * h[{k}].sum()" for k, c in term.parts)
        lines.append(f'    terms["{term.name}"] = {expr}')
    lines += [
        "    return terms",
        "",
        "def weights_step(model, batch, weights):",
        "    terms = step(model, batch)",
    ]
    first = cfg.terms[0].name
    lines.append(f'    total = weights["{first}"] * terms["{first}"]')
    for term in cfg.terms[1:]:
        lines.append(f'    total = total + weights["{term.name}"] * terms["{term.name}"]')
    lines += ["    return total, terms", ""]
    source = "\n".join(lines)
    file = f"<gradprobe-property-model-{next(_counter)}>"
    linecache.cache[file] = (len(source), None, [line + "\n" for line in lines], file)
    namespace: dict[str, Any] = {"__name__": f"gradprobe_property_{file[1:-1].replace('-', '_')}"}
    exec(compile(source, file, "exec"), namespace)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = namespace["Model"]()
        x = torch.randn(ROWS, WIDTH, dtype=torch.float64)
    x.requires_grad_(cfg.x_requires_grad)
    return Generated(model, namespace["step"], namespace["weights_step"], {"x": x}, file, edge_lines)


# ---------------------------------------------------------------------------- the ground truth
@dataclass(frozen=True)
class Expected:
    """What the construction implies: per term, each parameter's flow, and whether the term has a graph."""

    flows: dict[str, dict[str, str]]  # term -> parameter -> none | zero | nonzero (frozen: none)
    has_graph: dict[str, bool]  # term.requires_grad
    breaks: dict[tuple[str, int], tuple[str, ...]]  # (kind, line) -> parameters it depends on


def expected_flow(cfg: Config, edge_lines: list[int]) -> Expected:
    params = cfg.params()
    trainable_modules = {m for _, m, trainable in params if trainable}
    module_params = {m: [n for n, mm, _ in params if mm == m] for m in range(len(cfg.frozen))}
    order = {n: i for i, (n, _, _) in enumerate(params)}
    nodes = cfg.nodes

    # Forward facts, as the lineage recorder tracks them: does a node's output require grad; which
    # parameters its value depends on (through every op but a Python number, and not through a
    # product with 0.0: x * 0 depends on nothing); which of those can still pass a gradient (live).
    trainable_params = {n for n, _, trainable in params if trainable}
    out_rg: list[bool] = []
    prov: list[set[str]] = []
    live: list[set[str]] = []
    for node in nodes:
        src_rg = cfg.x_requires_grad if node.src < 0 else out_rg[node.src]
        src_prov = set() if node.src < 0 else prov[node.src]
        src_live = set() if node.src < 0 else live[node.src]
        in_rg = src_rg and node.edge in (PASS, ZERO_MULT)
        out_rg.append(in_rg or node.module in trainable_modules)
        own = set(module_params[node.module])
        kept = node.edge not in ("item", ZERO_MULT)
        prov.append(own | (src_prov if kept else set()))
        live.append((own & trainable_params) | (src_live if node.edge == PASS else set()))

    # A cut names the parameters whose gradient it severs (and the frozen ones its values depend on:
    # they never carry a gradient). A cut of nothing live is not a break; a Python number leaving
    # torch is one whenever its value depends on parameters.
    frozen_params = {n for n, _, trainable in params if not trainable}
    breaks: dict[tuple[str, int], tuple[str, ...]] = {}
    for k, node in enumerate(nodes):
        if node.edge not in CUT_KINDS or node.src < 0:
            continue
        src_live, src_prov = live[node.src], prov[node.src]
        if node.edge == "item" and not src_live:
            severed = src_prov
        else:
            severed = src_live | (src_prov & frozen_params) if src_live else set()
        if severed:
            breaks[node.edge, edge_lines[k]] = tuple(sorted(severed, key=order.__getitem__))

    flows: dict[str, dict[str, str]] = {}
    has_graph: dict[str, bool] = {}
    for term in cfg.terms:
        contributions: dict[str, list[str]] = {n: [] for n, _, _ in params}
        if term.second is not None:
            k, c = term.second
            path = []
            while k >= 0:
                path.append(k)
                k = nodes[k].src
            # G = d(node.sum())/dx is a product of W^T diag(tanh') along the path; every weight and
            # bias on the path enters it. A zero edge or a zero coefficient makes G (or the term) 0.
            zero = c == 0.0 or any(nodes[j].edge == ZERO_MULT for j in path)
            for j in path:
                for n in module_params[nodes[j].module]:
                    contributions[n].append(ZERO if zero else NONZERO)
            has_graph[term.name] = True  # x requires grad and the path is uncut
        else:
            # Backward over the tree: the flow of d term / d node output.
            g = [NONE] * len(nodes)
            for k, c in term.parts:
                g[k] = combine(g[k], ZERO if c == 0.0 else NONZERO)
            for k in reversed(range(len(nodes))):
                node = nodes[k]
                if g[k] == NONE:
                    continue
                weight, bias = module_params[node.module]
                contributions[bias].append(g[k])
                # The weight's gradient is g ⊗ input: exactly zero when the input was multiplied by 0.
                contributions[weight].append(ZERO if node.edge == ZERO_MULT else g[k])
                if node.src >= 0 and node.edge in (PASS, ZERO_MULT):
                    g[node.src] = combine(g[node.src], ZERO if node.edge == ZERO_MULT else g[k])
            has_graph[term.name] = any(out_rg[k] for k, _ in term.parts)
        flows[term.name] = {
            n: combine(*contributions[n]) if trainable else NONE for n, _, trainable in params
        }
    return Expected(flows, has_graph, breaks)


# ---------------------------------------------------------------------------- the property
def scenario_expectations(cfg: Config, expected: Expected, mode: str) -> dict[str, dict[str, str] | None]:
    """Per default scenario: each parameter's status, or None where the run must fail (no grad path)."""
    names = [t.name for t in cfg.terms]
    scenarios = {f"{t} only": [t] for t in names}
    if len(names) > 1:
        scenarios["all"] = names
    out: dict[str, dict[str, str] | None] = {}
    for scenario, on in scenarios.items():
        if mode == "terms":
            live = [t for t in on if expected.has_graph[t]]
            if not live:
                out[scenario] = None
                continue
            out[scenario] = {
                p: combine(*(expected.flows[t][p] for t in live)) for p in expected.flows[names[0]]
            }
        else:
            # One backward of sum(w_t * term_t): a term weighted by an exact 0 still has its graph, so
            # what only switched-off terms reach reads zero, not none.
            if not any(expected.has_graph.values()):
                out[scenario] = None
                continue
            out[scenario] = {
                p: NONZERO
                if any(expected.flows[t][p] == NONZERO for t in on)
                else ZERO
                if any(expected.flows[t][p] != NONE for t in names if expected.has_graph[t])
                else NONE
                for p in expected.flows[names[0]]
            }
    return out


def check_flow_map(fm: gradprobe.FlowMap, cfg: Config, expected: Expected, mode: str) -> None:
    trainable = [n for n, _, t in cfg.params() if t]
    assert list(fm.trainable) == trainable
    assert fm.mode == mode
    for scenario, want in scenario_expectations(cfg, expected, mode).items():
        run = fm.run("eager", scenario)
        if want is None:
            assert run.error is not None and run.error.type == "NoGradPath", (mode, scenario, run.error)
            assert fm.cells_of("eager", scenario) == {}
            continue
        assert run.error is None, (mode, scenario, run.error)
        got = fm.statuses("eager", scenario)
        assert got == want, f"{mode}, {scenario}: gradprobe {got} != construction {want}"
        # The non-zero set, which is what judgements are made on, and the count the table shows.
        assert fm.reached("eager", scenario) == {p for p, s in want.items() if s == NONZERO}
        assert fm.count("eager", scenario) == (sum(s == NONZERO for s in want.values()), len(trainable))
        for p, cell in fm.cells_of("eager", scenario).items():
            if cell.status == NONE:
                assert cell.norm is None, p
            else:
                assert cell.norm is not None and math.isfinite(cell.norm), (p, cell)
                assert (cell.norm > 0) == (cell.status == NONZERO), (p, cell)


def check_model(cfg: Config) -> None:
    """The property: gradprobe (terms mode, weights mode) and the locator agree with the construction."""
    gen = generate(cfg)
    expected = expected_flow(cfg, gen.edge_lines)
    names = [t.name for t in cfg.terms]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Converting a tensor with requires_grad=True to a scalar")
        fm = gradprobe.probe(gen.model, gen.step, gen.batch, terms=names)
        check_flow_map(fm, cfg, expected, "terms")
        fm = gradprobe.probe(gen.model, gen.weights_step, gen.batch, terms=names)
        check_flow_map(fm, cfg, expected, "weights")
        breaks = locate_breaks(gen.model, lambda: gen.step(gen.model, gen.batch))
    found = {(b.kind, b.line): b for b in breaks}
    assert set(found) == set(expected.breaks), (
        f"locator {sorted(found)} != construction {sorted(expected.breaks)}"
    )
    for key, brk in found.items():
        assert brk.file == gen.file
        assert brk.code == linecache.getline(gen.file, brk.line).strip()
        assert brk.parameters == expected.breaks[key], key


@SETTINGS
@given(configs())
def test_flow_map_and_breaks_equal_the_construction(cfg: Config) -> None:
    check_model(cfg)


# ---------------------------------------------------------------------------- hand-picked examples
# Every kind of edge and term at least once, whatever hypothesis draws.
ALL_KINDS = Config(
    frozen=((False, False), (False, False), (False, False), (False, True), (False, False)),
    nodes=(
        Node(0, -1, PASS),  # 0
        Node(1, 0, "detach"),  # 1: m0 cut off
        Node(2, 0, ZERO_MULT),  # 2: m0 reached with gradient exactly 0, m2 weight 0
        Node(0, 2, "no_grad"),  # 3: m0 used twice (shared), cut
        Node(3, 0, "int_cast"),  # 4
        Node(3, 0, "item"),  # 5
        Node(1, -1, PASS),  # 6: second-order path x -> m1
    ),
    terms=(
        Term("t0", parts=((1, 1.0), (2, 1.0))),
        Term("t1", parts=((3, 1e-200), (4, 1.0), (5, 0.0))),
        Term("t2", second=(6, 1.0)),
        Term("t3", second=(2, 1e200)),
    ),
    x_requires_grad=True,
    seed=0,
)  # module m4 is used by no node: none everywhere


def test_hand_picked_example_covers_every_kind() -> None:
    gen = generate(ALL_KINDS)
    expected = expected_flow(ALL_KINDS, gen.edge_lines)
    assert {k for k, _ in expected.breaks} == set(CUT_KINDS)
    flows = expected.flows
    assert flows["t0"]["m0.weight"] == ZERO and flows["t0"]["m2.weight"] == ZERO
    assert flows["t0"]["m2.bias"] == NONZERO and flows["t0"]["m1.weight"] == NONZERO
    assert flows["t1"]["m0.weight"] == NONZERO  # tiny, through node 3 (m0 shared), not through the cut
    assert flows["t1"]["m2.bias"] == NONE and flows["t1"]["m3.weight"] == NONZERO
    assert all(flows[t]["m3.bias"] == NONE for t in flows)  # frozen
    assert flows["t2"]["m1.weight"] == NONZERO and flows["t2"]["m0.weight"] == NONE
    assert flows["t3"]["m0.weight"] == ZERO  # the zero edge makes d h2 / dx exactly zero
    assert all(flows[t]["m4.weight"] == NONE for t in flows)
    check_model(ALL_KINDS)


def test_a_term_without_graph_is_a_recorded_run_error() -> None:
    cfg = Config(
        frozen=((False, False), (True, True)),
        nodes=(Node(0, -1, PASS), Node(1, 0, "detach")),
        terms=(Term("t0", parts=((0, 1.0),)), Term("t1", parts=((1, 1.0),))),
        x_requires_grad=False,
        seed=1,
    )
    assert expected_flow(cfg, [0, 0]).has_graph == {"t0": True, "t1": False}
    check_model(cfg)


# ---------------------------------------------------------------------------- the properties bite
TINY = Config(
    frozen=((False, False),),
    nodes=(Node(0, -1, PASS),),
    terms=(Term("t0", parts=((0, 1e-200),)),),
    x_requires_grad=False,
    seed=0,
)


def _tiny_is_zero(original: Callable[[float], str]) -> Callable[[float], str]:
    def status_of(max_abs: float) -> str:  # a plausible "tolerance" that hides real, tiny gradients
        return "zero" if abs(max_abs) < 1e-30 else original(max_abs)

    return status_of


def _l2_squared(original: Callable[..., Any]) -> Callable[..., Any]:
    def reduce_grads(grads: Any) -> tuple[list[str], list[float | None]]:
        statuses, norms = original(grads)
        for i, g in enumerate(grads):
            if g is not None:  # the status from the squared L2 norm: 1e-200 squared is 0
                statuses[i] = gradprobe.status.status_of(float(g.pow(2).sum()))
        return statuses, norms

    return reduce_grads


BROKEN: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "tiny-as-zero": lambda mp: mp.setattr(
        gradprobe.status, "status_of", _tiny_is_zero(gradprobe.status.status_of)
    ),
    "l2-squared": lambda mp: mp.setattr(
        gradprobe.measure, "reduce_grads", _l2_squared(gradprobe.measure.reduce_grads)
    ),
}


def _fails(cfg: Config) -> bool:
    try:
        check_model(cfg)
    except AssertionError:
        return True
    return False


@pytest.mark.parametrize("broken", list(BROKEN))
def test_a_broken_status_function_is_caught(broken: str, monkeypatch: pytest.MonkeyPatch) -> None:
    check_model(TINY)  # sound as shipped
    BROKEN[broken](monkeypatch)
    with pytest.raises(AssertionError, match="gradprobe .* != construction"):
        check_model(TINY)
    assert _fails(ALL_KINDS)


def test_hypothesis_finds_the_broken_status_function_by_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    BROKEN["tiny-as-zero"](monkeypatch)
    found = hypothesis.find(
        configs(),
        _fails,
        # Generation only: shrinking would re-probe hundreds of models; any failing example will do.
        settings=settings(max_examples=500, deadline=None, database=None, phases=[Phase.generate]),
    )
    # Only a gradient below the broken threshold tells: a term with the tiny coefficient.
    coefficients = [c for t in found.terms for _, c in (*t.parts, *([t.second] if t.second else []))]
    assert 1e-200 in coefficients


def test_ground_truth_is_not_trivially_equal_to_anything() -> None:
    # The construction distinguishes all three flows in one model, and the cuts change them.
    expected = expected_flow(ALL_KINDS, [0] * len(ALL_KINDS.nodes))
    seen = {s for flows in expected.flows.values() for s in flows.values()}
    assert seen == {NONE, ZERO, NONZERO}
    uncut = Config(
        ALL_KINDS.frozen,
        tuple(Node(n.module, n.src, PASS) for n in ALL_KINDS.nodes),
        ALL_KINDS.terms,
        True,
        0,
    )
    assert expected_flow(uncut, [0] * len(uncut.nodes)).flows != expected.flows
