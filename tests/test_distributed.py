"""gradprobe.distributed: per-rank gradient flow under torch.distributed (gloo on CPU).

Every multi-process case runs in its own subprocess (this file run as a script), in a new session
that is killed as a whole on timeout, so a rank blocked in a collective cannot hang the suite. The
ranks are forked from that subprocess (``torch.multiprocessing.start_processes``, start method
``fork``): torch is imported once per case, not once per rank. Each rank writes what it saw as JSON
into the test's tmp_path; the tests assert on those files.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import gradprobe
from gradprobe.causes.ddp_locally_unused import DDP_ERROR
from gradprobe.distributed import merge_maps
from gradprobe.report.ranks import render_ranks

HERE = Path(__file__).resolve()
TIMEOUT = 120


# ----- the model and data of the tests ----------------------------------------------------------


class TypedModel(torch.nn.Module):
    """Per-atom energies: an embedding per atom type, then a branch module per type, applied only to
    the atoms of that type (a rank whose batch has no atom of type 1 never runs ``branch_type1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(2, 4)
        self.branch_type0 = torch.nn.Linear(4, 4)
        self.branch_type1 = torch.nn.Linear(4, 4)
        self.out = torch.nn.Linear(4, 1)

    def forward(self, atype: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        h = self.embed(atype) + feat  # (frames, atoms, 4)
        flat_h, flat_t = h.reshape(-1, 4), atype.reshape(-1)
        atom_e = torch.zeros(flat_t.shape[0], 1, dtype=h.dtype)
        for t, branch in ((0, self.branch_type0), (1, self.branch_type1)):
            idx = torch.nonzero(flat_t == t).flatten()
            if idx.numel():
                atom_e = atom_e.index_put((idx,), self.out(torch.tanh(branch(flat_h[idx]))))
        return atom_e.reshape(atype.shape)  # per-atom energies


def make_model(seed: int = 0) -> TypedModel:
    torch.manual_seed(seed)
    return TypedModel().double()


def make_batch(types: list[int], seed: int, frames: int = 2, atoms: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    choice = torch.tensor(types)[torch.randint(len(types), (frames, atoms), generator=g)]
    if len(types) > 1:  # every listed type present
        choice.view(-1)[: len(types)] = torch.tensor(types)
    return {
        "atype": choice,
        "feat": torch.randn(frames, atoms, 4, generator=g, dtype=torch.float64),
        "energy": torch.randn(frames, generator=g, dtype=torch.float64),
    }


def concat(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Terms mode: means over frames / atoms, so equal per-rank batches average like one batch."""
    atom_e = model(batch["atype"], batch["feat"])
    return {
        "energy": (atom_e.sum(dim=1) - batch["energy"]).pow(2).mean(),
        "smooth": atom_e.pow(2).mean(),
    }


def weighted_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], w: Any) -> Any:
    terms = step(model, batch)
    return w["energy"] * terms["energy"] + w["smooth"] * terms["smooth"], terms


# ----- running cases in subprocesses -------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], timeout: float, cwd: Path | None = None) -> tuple[int, str, str, float]:
    """Run in a new session; on timeout kill the whole session (the ranks too) and fail."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env,
        cwd=cwd,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd} did not finish within {timeout}s\nstdout:\n{out}\nstderr:\n{err[-4000:]}")
    return proc.returncode, out, err, time.perf_counter() - start


def launch(case: str, tmp_path: Path, nproc: int = 2) -> tuple[int, str, str]:
    code, out, err, _ = _run(
        [sys.executable, str(HERE), case, str(tmp_path), str(nproc), str(_free_port())], TIMEOUT
    )
    return code, out, err


def _rank_entry(rank: int, case: str, out: str, nproc: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        CASES[case](rank, nproc, Path(out))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _save(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data))


def _load(path: Path) -> Any:
    return json.loads(path.read_text())


def case_branch(rank: int, world: int, out: Path) -> None:
    """DDP without find_unused_parameters; rank 0's batch has only type 0, rank 1's types 0 and 1."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from gradprobe.distributed import init_from_env, probe_distributed

    init_from_env()
    ddp = DistributedDataParallel(make_model())
    batch = make_batch([0] if rank == 0 else [0, 1], seed=10 + rank)
    fm = probe_distributed(gradprobe.ProbeSpec(model=ddp, step=step, batch=batch))
    _save(out / f"branch-{rank}.json", fm.to_dict())
    if rank == 0:
        (out / "branch-report.txt").write_text(gradprobe.render(fm) + render_ranks(fm))
    dist.barrier()


def case_ddp_fails(rank: int, world: int, out: Path) -> None:
    """The same data trained with DDP: with find_unused_parameters=True (probed first) it trains;
    without, the second iteration raises DDP's "Expected to have finished reduction" error on rank 0."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from gradprobe.distributed import probe_distributed

    dist.init_process_group("gloo")
    batch = make_batch([0] if rank == 0 else [0, 1], seed=10 + rank)
    for find_unused in (True, False):
        ddp = DistributedDataParallel(make_model(), find_unused_parameters=find_unused)
        if find_unused:  # probed first: the wrapper trains on afterwards
            fm = probe_distributed(gradprobe.ProbeSpec(model=ddp, step=step, batch=batch))
            _save(out / f"handled-{rank}.json", fm.to_dict())
        for it in range(2):
            sys.stdout.write(f"rank {rank} find_unused_parameters={find_unused} iteration {it}\n")
            sys.stdout.flush()
            try:
                sum(step(ddp, batch).values()).backward()
            except RuntimeError as e:  # printed here: the launcher reports only the first rank to fail
                sys.stdout.write(f"rank {rank} raised: {e}\n")
                sys.stdout.flush()
                raise
        sys.stdout.write(f"rank {rank} find_unused_parameters={find_unused} trained\n")
        sys.stdout.flush()
        dist.barrier()


def case_clean(rank: int, world: int, out: Path) -> None:
    """Every rank's batch has both types: per term (DDP-wrapped) and per weight, against one process on
    the concatenated batch; then a plain model whose rank 1 copy was changed (rank divergence)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from gradprobe.distributed import init_from_env, probe_distributed

    init_from_env()
    batches = [make_batch([0, 1], seed=20 + r) for r in range(world)]
    ddp = DistributedDataParallel(make_model())
    before = [p.detach().clone() for p in ddp.parameters()]
    spec = gradprobe.ProbeSpec(model=ddp, step=step, batch=batches[rank])
    fm = probe_distributed(spec)
    fm_w = probe_distributed(
        gradprobe.ProbeSpec(model=ddp, step=weighted_step, batch=batches[rank], terms=["energy", "smooth"])
    )
    unchanged = all(torch.equal(a, b) for a, b in zip(before, ddp.parameters(), strict=True)) and all(
        p.grad is None for p in ddp.parameters()
    )
    # The wrapper still trains normally after the probe.
    sum(step(ddp, batches[rank]).values()).backward()
    result = {"merged": fm.to_dict(), "merged_w": fm_w.to_dict(), "unchanged": unchanged}
    if rank == 0:
        single = gradprobe.probe(make_model(), step, concat(batches))
        single_w = gradprobe.probe(make_model(), weighted_step, concat(batches), terms=["energy", "smooth"])
        result.update(single=single.to_dict(), single_w=single_w.to_dict())
    plain = make_model()
    if rank == 1:
        with torch.no_grad():
            plain.branch_type0.bias[0] += 1e-3
    fm_div = probe_distributed(gradprobe.ProbeSpec(model=plain, step=step, batch=batches[rank]))
    result["divergence"] = fm_div.to_dict()
    _save(out / f"clean-{rank}.json", result)
    dist.barrier()


def case_fsdp2(rank: int, world: int, out: Path) -> None:
    """FSDP2 (fully_shard) on gloo. Clean data, every module its own FSDP unit: FSDP's reduce-scatter,
    and rank 1's shard of ``out.bias`` is empty. Then rank 0 never uses branch_type1 (the branches
    sharded with the root): the local gradients are all-reduced instead."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from gradprobe.distributed import init_from_env, probe_distributed

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    init_from_env()
    result: dict[str, Any] = {}
    for name, types, units in (("clean", [[0, 1], [0, 1]], True), ("branch", [[0], [0, 1]], False)):
        batches = [make_batch(types[r], seed=30 + r) for r in range(world)]
        model = make_model()
        if units:
            for m in (model.branch_type0, model.branch_type1, model.out):
                fully_shard(m)
        fully_shard(model)
        fm = probe_distributed(gradprobe.ProbeSpec(model=model, step=step, batch=batches[rank]))
        result[name] = {
            "merged": fm.to_dict(),
            "shard_sizes": {n: p.to_local().numel() for n, p in model.named_parameters()},
            "sharded_after": all(
                type(p).__name__ == "DTensor" and p.grad is None for p in model.parameters()
            ),
        }
        if rank == 0:
            result[name]["single"] = gradprobe.probe(make_model(), step, concat(batches)).to_dict()
    _save(out / f"fsdp2-{rank}.json", result)
    dist.barrier()


CASES = {"branch": case_branch, "ddp_fails": case_ddp_fails, "clean": case_clean, "fsdp2": case_fsdp2}


# ----- tests --------------------------------------------------------------------------------------


def _norms(fm: gradprobe.FlowMap, variant: str = "eager") -> dict[tuple[str, str], float | None]:
    return {(c.scenario, c.parameter): c.norm for c in fm.cells if c.variant == variant}


def _close(a: dict, b: dict, rtol: float = 1e-10) -> list[Any]:
    bad = []
    for k in a:
        x, y = a[k], b[k]
        if (x is None) != (y is None) or (x is not None and abs(x - y) > rtol * max(abs(x), abs(y), 1e-300)):
            bad.append((k, x, y))
    return bad


def test_locally_unused_branch_and_ddp_failure(tmp_path: Path) -> None:
    code, out, err = launch("branch", tmp_path)
    assert code == 0, err[-4000:]
    fm0 = gradprobe.FlowMap.from_dict(_load(tmp_path / "branch-0.json"))
    fm1 = gradprobe.FlowMap.from_dict(_load(tmp_path / "branch-1.json"))
    assert fm0 == fm1  # every rank returns the same merged map
    (f,) = [f for f in fm0.findings if f.cause == "ddp-locally-unused"]
    assert f.severity == "error"
    assert set(f.evidence["parameters"]) == {"branch_type1.weight", "branch_type1.bias"}
    for per_scenario in f.evidence["ranks"].values():
        for entry in per_scenario.values():
            assert (
                entry["reached_on"] == [1] and entry["not_reached_on"] == [0] and entry["no_path_on"] == [0]
            )
    assert "find_unused_parameters=True" in f.fix and "static_graph" in f.fix
    assert DDP_ERROR in f.message
    d = fm0.checks["distributed"]
    assert d["world_size"] == 2 and d["backend"] == "gloo" and d["wrapper"] == "ddp"
    assert d["find_unused_parameters"] is False
    assert d["ranks"]["all"]["branch_type1.weight"] == [1]
    assert d["ranks"]["all"]["branch_type0.weight"] == [0, 1]
    assert d["no_path"]["all"] == {"branch_type1.weight": [0], "branch_type1.bias": [0]}
    # merged: reached if any rank reaches it; names without DDP's "module." prefix
    assert fm0.reached("eager", "all") == set(fm0.trainable)
    assert not any(p.startswith("module.") for p in fm0.trainable)
    assert fm0.exit_code == 1
    report = (tmp_path / "branch-report.txt").read_text()
    assert "ddp-locally-unused" in report and "rank 0" in report

    # Plain DDP without find_unused_parameters really fails on this model (its own subprocess).
    code, out, err = launch("ddp_fails", tmp_path)
    assert "rank 0 find_unused_parameters=True trained" in out
    assert "rank 1 find_unused_parameters=True trained" in out
    assert code != 0
    assert "Expected to have finished reduction in the prior iteration" in out + err
    handled = gradprobe.FlowMap.from_dict(_load(tmp_path / "handled-0.json"))
    (f,) = [f for f in handled.findings if f.cause == "ddp-locally-unused"]
    assert f.severity == "info" and "handled by find_unused_parameters=True" in f.message
    assert handled.checks["distributed"]["find_unused_parameters"] is True


def test_clean_run_matches_one_process_on_concatenated_batch(tmp_path: Path) -> None:
    code, _, err = launch("clean", tmp_path)
    assert code == 0, err[-4000:]
    r0, r1 = _load(tmp_path / "clean-0.json"), _load(tmp_path / "clean-1.json")
    assert r0["unchanged"] and r1["unchanged"]
    for key, single_key in (("merged", "single"), ("merged_w", "single_w")):
        merged = gradprobe.FlowMap.from_dict(r0[key])
        single = gradprobe.FlowMap.from_dict(r0[single_key])
        assert merged == gradprobe.FlowMap.from_dict(r1[key])
        assert merged.trainable == single.trainable  # DDP-wrapped: names without "module."
        for s in single.scenario_names:
            assert merged.reached("eager", s) == single.reached("eager", s), s
            assert merged.statuses("eager", s) == single.statuses("eager", s), s
        assert not _close(_norms(merged), _norms(single))
        assert not [f for f in merged.findings if f.cause.startswith("ddp-") or f.cause == "rank-divergence"]
        d = merged.checks["distributed"]
        assert all(rs == [0, 1] for rs in d["ranks"]["all"].values())
        # term values are the mean over ranks: the loss of the concatenated batch
        for run in single.runs:
            got = merged.run("eager", run.scenario).term_values
            assert all(abs(got[t] - v) < 1e-12 for t, v in run.term_values.items() if v is not None)
    div = gradprobe.FlowMap.from_dict(r0["divergence"])
    (f,) = [f for f in div.findings if f.cause == "rank-divergence"]
    assert f.severity == "error" and f.evidence["parameters"] == ["branch_type0.bias"]
    assert f.evidence["ranks"] == [1]
    assert div.checks["distributed"]["wrapper"] == "none"


def test_fsdp2_sharded_gradients(tmp_path: Path) -> None:
    code, _, err = launch("fsdp2", tmp_path)
    assert code == 0, err[-4000:]
    r0, r1 = _load(tmp_path / "fsdp2-0.json"), _load(tmp_path / "fsdp2-1.json")
    for name in ("clean", "branch"):
        assert r0[name]["sharded_after"] and r1[name]["sharded_after"], name
        merged = gradprobe.FlowMap.from_dict(r0[name]["merged"])
        single = gradprobe.FlowMap.from_dict(r0[name]["single"])
        assert merged == gradprobe.FlowMap.from_dict(r1[name]["merged"])
        for s in single.scenario_names:
            assert merged.statuses("eager", s) == single.statuses("eager", s), (name, s)
        assert not _close(_norms(merged), _norms(single)), name
        assert merged.checks["distributed"]["wrapper"] == "fsdp2"
    clean = gradprobe.FlowMap.from_dict(r0["clean"]["merged"])
    assert r1["clean"]["shard_sizes"]["out.bias"] == 0  # rank 1 holds an empty shard of out.bias
    assert "out.bias" in clean.reached("eager", "all")
    assert clean.checks["distributed"]["reduced_by"].startswith("FSDP2 reduce-scatter")
    assert not [f for f in clean.findings if f.cause.startswith("ddp-")]
    branch = gradprobe.FlowMap.from_dict(r0["branch"]["merged"])
    assert branch.checks["distributed"]["reduced_by"] == "all-reduce of the local gradients"
    (f,) = [f for f in branch.findings if f.cause == "ddp-locally-unused"]
    assert set(f.evidence["parameters"]) == {"branch_type1.weight", "branch_type1.bias"}
    assert f.severity == "error" and "set_reduce_scatter_unused_params(True)" in f.fix


SPEC_FILE = """
import torch
from torch.nn.parallel import DistributedDataParallel

import gradprobe


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(3, 4)
        self.head_a = torch.nn.Linear(4, 1)
        self.head_b = torch.nn.Linear(4, 1)

    def forward(self, x, use_b):
        h = torch.tanh(self.body(x))
        return self.head_a(h) + (self.head_b(h) if use_b else 0.0)


def spec(rank=0, world_size=1):
    torch.manual_seed(0)
    model = DistributedDataParallel(TwoHeads().double())
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(5, 3, generator=g, dtype=torch.float64)
    y = torch.randn(5, 1, generator=g, dtype=torch.float64)

    def step(m, b):
        return {"fit": (m(b["x"], b["use_b"]) - b["y"]).pow(2).mean()}

    return gradprobe.ProbeSpec(model=model, step=step, batch={"x": x, "y": y, "use_b": rank == 1})
"""


def test_cli_nproc_end_to_end(tmp_path: Path) -> None:
    """Rank 1 alone uses head_b: the merged report (printed once, by rank 0) says ddp-locally-unused,
    the exit status is 1 (rank 0's: an error finding), and the JSON is the merged map."""
    (tmp_path / "dist_spec.py").write_text(textwrap.dedent(SPEC_FILE))
    json_path = tmp_path / "flow.json"
    code, out, err, seconds = _run(
        [sys.executable, "-m", "gradprobe", "run", "dist_spec.py", "--nproc", "2", "--json", str(json_path)],
        timeout=TIMEOUT,
        cwd=tmp_path,
    )
    assert code == 1, out + err[-4000:]
    assert out.count("gradprobe: PROBLEM") == 1, out  # the report, printed once: by rank 0
    assert out.count("ERROR ddp-locally-unused") == 1
    assert out.count("distributed: 2 ranks") == 1
    assert out.count("flow map written to") == 1
    fm = gradprobe.FlowMap.from_json(json_path)
    d = fm.checks["distributed"]
    assert d["world_size"] == 2 and d["wrapper"] == "ddp"
    assert d["ranks"]["fit only"]["head_b.weight"] == [1]
    assert fm.count("eager", "fit only") == (6, 6)
    assert [f.cause for f in fm.findings if f.severity == "error"] == ["ddp-locally-unused"]
    assert seconds < 60, seconds


def test_cli_nproc_exit_status_is_rank_zeros(tmp_path: Path) -> None:
    """Exit status 2 for a spec error, raised on every rank and reported once."""
    (tmp_path / "bad_spec.py").write_text("def spec():\n    return 42\n")
    code, out, err, _ = _run(
        [sys.executable, "-m", "gradprobe", "run", "bad_spec.py", "--nproc", "2"],
        timeout=TIMEOUT,
        cwd=tmp_path,
    )
    assert code == 2, out + err[-4000:]
    assert err.count("expected a gradprobe.ProbeSpec") == 1, err


def test_cli_nproc_option_is_not_passed_to_torchrun() -> None:
    from gradprobe.cli import _without_nproc, build_parser, main

    assert build_parser().parse_args(["run", "x.py", "--nproc", "2"]).nproc == 2
    argv = ["run", "x.py", "--nproc", "2", "--json", "f.json", "--nproc=3", "--npr", "4", "--all"]
    assert _without_nproc(argv) == ["run", "x.py", "--json", "f.json", "--all"]
    assert main(["run", "x.py", "--nproc", "0"]) == 2


# ----- merging, in process -------------------------------------------------------------------------


def _local_maps(world_types: list[list[int]], model: TypedModel | None = None) -> list[gradprobe.FlowMap]:
    return [
        gradprobe.probe(model or make_model(), step, make_batch(types, seed=40 + r))
        for r, types in enumerate(world_types)
    ]


def _info(**kw: Any) -> dict[str, Any]:
    return {"world_size": 2, "backend": "gloo", "wrapper": "ddp", "find_unused_parameters": False, **kw}


def test_merge_severity_follows_the_ddp_settings() -> None:
    maps = _local_maps([[0], [0, 1]])
    fm = merge_maps(maps, {}, {"parameters": {}}, _info())
    (f,) = [f for f in fm.findings if f.cause == "ddp-locally-unused"]
    assert f.severity == "error"
    handled = merge_maps(maps, {}, {"parameters": {}}, _info(find_unused_parameters=True))
    (f,) = [f for f in handled.findings if f.cause == "ddp-locally-unused"]
    assert f.severity == "info" and "handled by find_unused_parameters=True" in f.message
    # Without reduced gradients, other cells combine the ranks: reached if any rank reaches it.
    assert fm.reached("eager", "all") == set(fm.trainable)
    assert fm.cell("eager", "all", "branch_type1.bias").norm == pytest.approx(
        maps[1].cell("eager", "all", "branch_type1.bias").norm / 2
    )
    assert "rank 0" in render_ranks(fm) and "merged" in render_ranks(fm)


def test_merge_globally_unused_with_and_without_notes() -> None:
    maps = _local_maps([[0], [0]])
    fm = merge_maps(maps, {}, {"parameters": {}}, _info())
    (f,) = [f for f in fm.findings if f.cause == "ddp-globally-unused"]
    assert f.severity == "warning" and set(f.evidence["parameters"]) == {
        "branch_type1.weight",
        "branch_type1.bias",
    }
    assert "requires_grad_(False)" in f.fix and "find_unused_parameters=True" in f.fix
    assert not [f for f in fm.findings if f.cause in ("ddp-locally-unused", "unused-parameter")]
    noted = [
        gradprobe.probe(
            make_model(), step, make_batch([0], seed=40 + r), notes={"branch_type1": "type 1 only"}
        )
        for r in range(2)
    ]
    fm = merge_maps(noted, {}, {"parameters": {}}, _info())
    (f,) = [f for f in fm.findings if f.cause == "ddp-globally-unused"]
    assert f.severity == "info" and "type 1 only" in f.message


def test_merge_exact_zero_on_a_rank_is_not_a_ddp_error() -> None:
    """A rank that reaches a branch with an exact zero gradient has a path: DDP's hooks fire. With the
    zero-weighted touch in the energy term only, the smooth term alone still has no path on rank 0."""

    def touching(terms_touched: tuple[str, ...]) -> Any:
        def zero_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            terms = step(model, batch)
            touch = sum(p.sum() for p in model.branch_type1.parameters())
            return {t: v + 0.0 * touch if t in terms_touched else v for t, v in terms.items()}

        return zero_step

    def finding(terms_touched: tuple[str, ...]) -> gradprobe.Finding:
        maps = [
            gradprobe.probe(make_model(), touching(terms_touched), make_batch(t, seed=50 + r))
            for r, t in enumerate([[0], [0, 1]])
        ]
        (f,) = [
            f
            for f in merge_maps(maps, {}, {"parameters": {}}, _info()).findings
            if f.cause == "ddp-locally-unused"
        ]
        return f

    f = finding(("energy", "smooth"))
    assert f.severity == "info" and "exact zero" in f.message
    assert f.evidence["ranks"]["branch_type1.weight"]["all"] == {
        "reached_on": [1],
        "not_reached_on": [0],
        "no_path_on": [],
    }
    f = finding(("energy",))
    assert f.severity == "warning" and "'smooth only' only" in f.message
    assert f.evidence["ranks"]["branch_type1.weight"]["smooth only"]["no_path_on"] == [0]
    assert f.evidence["ranks"]["branch_type1.weight"]["all"]["no_path_on"] == []


def test_probe_distributed_without_process_group_says_how_to_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from gradprobe.distributed import probe_distributed

    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    spec = gradprobe.ProbeSpec(model=make_model(), step=step, batch=make_batch([0], seed=0))
    with pytest.raises(gradprobe.SpecError, match="torchrun"):
        probe_distributed(spec)


if __name__ == "__main__":
    import torch._dynamo  # DDP imports it: once here, not once per forked rank
    import torch.multiprocessing as mp

    _case, _out, _nproc, _port = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    mp.start_processes(_rank_entry, args=(_case, _out, _nproc, _port), nprocs=_nproc, start_method="fork")
