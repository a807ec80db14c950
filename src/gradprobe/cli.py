"""The ``gradprobe`` command.

Exit status: 0 when no finding has severity ``error``; 1 when one does; 2 on a usage or input error
(bad arguments, a spec file that cannot be loaded, a step that breaks its contract); 3 when gradprobe
itself crashed (one line, the traceback with ``-v``). Info findings, such as a deliberately unused
head, never fail it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import importlib.util
import inspect
import os
import sys
import traceback
from collections.abc import Iterator, Mapping, Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Any

from _gradprobe_cli import crashed

from . import __version__
from .errors import GradProbeError, SpecError
from .flowmap import FlowMap
from .progress import reporting, stage
from .quiet import shown
from .report.controls import visible
from .report.styled import write_report
from .spec import ProbeSpec

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2  # and 3, EXIT_INTERNAL: gradprobe itself crashed
DTYPES = ("float64", "float32", "bfloat16", "float16")


VARIANTS_HELP = (
    "comma-separated variants to compare (default: the spec's, else eager), e.g. eager,make_fx,compile:aot_eager,"
    "make_fx[detach=alias]+compile:inductor; backends: eager, aot_eager, aot_eager_decomp_partition, inductor; "
    "knobs in brackets: mode=train|eval, autocast=bf16|fp16, detach=keep|alias, tracing_mode=real|symbolic, "
    "pre_dispatch=true, fullgraph=true, dynamic=true|false"
)


class _Parser(argparse.ArgumentParser):
    """argparse with a did-you-mean: a mistyped option is refused by the parser of its command (with
    that command's usage, not the top level's), a mistyped command by the top level."""

    _commands: Any = None  # the subparsers action, on the top-level parser

    def add_subparsers(self, **kwargs: Any) -> Any:
        self._commands = super().add_subparsers(**kwargs)
        return self._commands

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self._commands is not None:
            given = sys.argv[1:] if args is None else list(args)
            command = next((a for a in given if not a.startswith("-")), None)
            names = list(self._commands.choices)
            if command is not None and command not in names:
                self.error(f"unknown command {command!r}{_did_you_mean(command, names)}; the commands are "
                           f"{', '.join(names)}")  # fmt: skip
        namespace, extras = super().parse_known_args(args, namespace)
        unknown = [a for a in extras if a.startswith("-") and a != "-"]
        if unknown:
            options = [o for action in self._actions for o in action.option_strings]
            hint = _did_you_mean(unknown[0].split("=")[0], options)
            self.error(f"unrecognized argument {unknown[0]}{hint}")
        return namespace, extras


def _did_you_mean(given: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(given, choices, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variants", help=VARIANTS_HELP)
    p.add_argument("--reference", help="the variant the others are compared with (default: the first)")
    p.add_argument(
        "--all", action="store_true", help="show every parameter in the diff, not only what differs"
    )
    p.add_argument("--json", metavar="PATH", help="write the flow map as JSON to PATH")
    _report_options(p)
    _fail_on(p)
    _verbose(p)
    p.add_argument(
        "--check",
        action="append",
        default=[],
        metavar="CHECKS",
        help="verification checks, comma-separated or repeated: physics (forces/virial vs finite differences), "
        "shapes (traced variants on a batch of other shapes), training (a few optimizer steps per term on a "
        "copy), balance (how the terms' gradients compare and conflict); a trainer adapter's own: for a DeePMD "
        "input, backends (pt against pt_expt; DeePMD's metrics are always checked)",
    )
    p.add_argument(
        "--quiet",
        "-q",
        action="store_true",
        help="no progress on stderr (by default: which variant and stage runs, once a probe takes over a second)",
    )
    p.add_argument(
        "--expect",
        action="append",
        default=[],
        metavar="'SCENARIO=PREFIX[,PREFIX]'",
        help="declare what a scenario must reach, e.g. --expect 'force only=fitting' (parameter names or module "
        "prefixes; SCENARIO!=PREFIX: must not reach); repeatable, added to the spec's expect=. A broken "
        "declaration is an expectation-unmet error, located with --diagnose",
    )
    p.add_argument(
        "--diagnose",
        action="store_true",
        help="bisect failing variants' knobs and locate the break in the model (extra traces and compiles)",
    )
    p.add_argument(
        "--compiler-bisect",
        action="store_true",
        help="with --diagnose: when a backend (aot_eager_decomp_partition, inductor) changes the gradients, let "
        "torch's CompilerBisector name the pass, decomposition or lowering (a rebuild and compile per trial)",
    )


def _verbose(p: argparse.ArgumentParser, default: Any = argparse.SUPPRESS) -> None:
    """``-v``, before or after the command (a command's own default must not undo ``gradprobe -v run``)."""
    p.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        default=default,
        help="let torch's warnings and logging during the probe through to stderr (otherwise counted in the "
        "report), and on a crash of gradprobe itself print the traceback",
    )


def _fail_on(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--fail-on",
        choices=("error", "warning"),
        default="error",
        help="which findings make the exit status 1: error (default), or warning too (say a stop-gradient the "
        "spec's notes do not declare)",
    )


def _failing(fm: FlowMap, args: argparse.Namespace) -> FlowMap:
    import msgspec

    return msgspec.structs.replace(fm, fail_on=args.fail_on) if args.fail_on != fm.fail_on else fm


def _report_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--html", metavar="PATH", help="write a self-contained HTML report to PATH")
    p.add_argument("--markdown", metavar="PATH", help="write a Markdown report (for a PR comment) to PATH")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="gradprobe",
        description="Which parameters does each loss term reach, eager and compiled, and why not.",
        epilog="exit status: 0 no error finding, 1 error findings, 2 usage or input error, 3 gradprobe crashed",
    )
    parser.add_argument("--version", action="version", version=f"gradprobe {__version__}")
    _verbose(parser, default=False)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="probe the built-in reference potential (energy, force, virial)")
    _common(demo)
    demo.add_argument("--device", default="cpu", help="device to run on (default: cpu)")
    demo.add_argument("--dtype", default="float64", choices=DTYPES, help="precision (default: float64)")
    demo.add_argument(
        "--mode",
        default="terms",
        choices=("terms", "weights"),
        help="step contract: per-term dict (terms) or per-term weights (weights)",
    )
    demo.add_argument("--no-virial", action="store_true", help="data without virial labels (no virial term)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the synthetic data and weights")
    demo.add_argument(
        "--bug",
        metavar="ID",
        help="inject a known bug into the reference potential and diagnose it (--bug list)",
    )

    run = sub.add_parser(
        "run",
        help="probe a spec: FILE.py[:FUNCTION], FUNCTION returning a gradprobe.ProbeSpec or a trainer adapter",
    )
    run.add_argument("target", metavar="FILE.py[:FUNCTION]", help="FUNCTION defaults to 'spec'")
    _common(run)
    run.add_argument("--device", help="passed to FUNCTION as device= if it takes one")
    run.add_argument("--dtype", choices=DTYPES, help="passed to FUNCTION as dtype= if it takes one")
    run.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="probe N ranks under torch.distributed (relaunches through torch.distributed.run; gloo on CPU, "
        "NCCL for CUDA tensors): each rank calls FUNCTION (with rank= and world_size= if it takes them) for "
        "its own batch; rank 0 prints the merged report and writes the files",
    )

    report = sub.add_parser(
        "report",
        help="render a saved flow map (terminal, or --html / --markdown files); exit 0/1 by findings",
        description="Render a flow map saved with --json: the terminal report, or the --html / --markdown files.",
        epilog="exit status: 0 the map holds no error finding, 1 it holds error findings (as the run that "
        "wrote it), 2 the file cannot be read or is not a flow map (or a usage error), 3 gradprobe crashed",
    )
    report.add_argument("flowmap", metavar="FLOW.json", help="a flow map written with --json")
    _verbose(report)
    _report_options(report)
    report.add_argument("--all", action="store_true", help="show every parameter in the terminal diff")
    _fail_on(report)

    diff = sub.add_parser("diff", help="compare two saved flow maps; exit 1 if the flow changed, 0 if not")
    _verbose(diff)
    diff.add_argument("before", metavar="A.json")
    diff.add_argument("after", metavar="B.json")
    diff.add_argument(
        "--norm-rtol",
        type=float,
        metavar="X",
        help="report norms that moved by more than X (relative) as info (default: the maps' rtol; 0: off)",
    )
    return parser


@contextlib.contextmanager
def load_spec(target: str, **kwargs: Any) -> Iterator[Any]:
    """Import FILE.py and call FUNCTION (default ``spec``), passing only the keywords it accepts; the
    block gets a ``ProbeSpec``, or a trainer adapter (``gradprobe.trainer.TrainerAdapter``).

    The file is imported as a module (``gradprobe_user_<stem>``) that stays in ``sys.modules`` until the
    block ends, as an imported one would: dynamo resolves a compiled frame's globals through it, so a
    spec behaves the same from the command line and from the Python API."""
    path_text, _, func_name = target.rpartition(":") if ":" in target else (target, "", "")
    path = Path(path_text)
    func_name = func_name or "spec"
    if not path.is_file():
        raise SpecError(f"spec file {str(path)!r} not found")
    if path.suffix == ".json":
        from .adapters.deepmd import adapter_from_input

        yield adapter_from_input(path)
        return
    name = f"gradprobe_user_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise SpecError(f"cannot import {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    previous = sys.modules.get(name)
    sys.modules[name] = module  # during the import too: a dataclass in the file looks its module up
    try:
        yield _call_spec(path, module_spec, module, func_name, kwargs)
    finally:
        if sys.modules.get(name) is module:
            del sys.modules[name]
        if previous is not None:
            sys.modules[name] = previous


def _call_spec(
    path: Path, module_spec: ModuleSpec, module: ModuleType, func_name: str, kwargs: Mapping[str, Any]
) -> Any:
    assert module_spec.loader is not None
    sys.path.insert(0, str(path.resolve().parent))  # so the spec can import its neighbours
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's code: one line naming its file and line, not a traceback
        raise _user_error(path, e, f"while importing {path}") from None
    finally:
        sys.path.remove(str(path.resolve().parent))
    func = getattr(module, func_name, None)
    if not callable(func):
        found = [
            n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__
        ]
        raise SpecError(
            f"{path} has no function {func_name!r}; its functions are: {', '.join(found) or 'none'} "
            f"(name one with {path}:FUNCTION)"
        )
    accepted = inspect.signature(func).parameters
    try:
        result = func(**{k: v for k, v in kwargs.items() if v is not None and k in accepted})
    except GradProbeError:
        raise
    except Exception as e:
        raise _user_error(path, e, f"in {func_name}()") from None
    if not isinstance(result, ProbeSpec) and not _is_adapter(result):
        raise SpecError(
            f"{path}:{func_name}() returned {type(result).__name__}, expected a gradprobe.ProbeSpec "
            "or a trainer adapter (gradprobe.trainer)"
        )
    return result


def _user_error(path: Path, e: BaseException, doing: str) -> SpecError:
    """The innermost line of the spec file in the traceback (for a syntax error, the line itself),
    the exception's first line, and where else it was raised when that is another file."""
    mine = path.resolve()
    first = str(e.msg if isinstance(e, SyntaxError) else e).strip().splitlines()
    text = f"{type(e).__name__}: {first[0] if first else ''}".rstrip(": ")
    frames = traceback.extract_tb(e.__traceback__)
    if isinstance(e, SyntaxError) and e.filename and e.lineno:
        frames.append(traceback.FrameSummary(e.filename, e.lineno, "<module>"))
    own = [f for f in frames if _same_file(f.filename, mine)]
    where = f"{path}:{own[-1].lineno}" if own else str(path)
    elsewhere = (
        f" (raised at {frames[-1].filename}:{frames[-1].lineno})" if frames and frames[-1] not in own else ""
    )
    return SpecError(f"{where}: {text}{elsewhere} ({doing})")


def _same_file(name: str, path: Path) -> bool:
    try:
        return Path(name).resolve() == path
    except (OSError, ValueError):
        return False


def _check_device(name: str | None) -> None:
    """``--device``: a torch device that can hold a tensor here, checked before anything runs. The
    error is one line: what is missing, what is available (never torch's list of dispatch keys)."""
    if name is None:
        return
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise SpecError(
            f"--device {name}: not a torch device (available: {', '.join(_available_devices())})"
        ) from None
    try:
        torch.empty(0, device=device)
    except Exception as e:
        kind = device.type.upper() if device.type in ("cuda", "mps", "xpu") else device.type
        count = _device_count(device.type)
        if count == 0:
            why = f"this torch ({torch.__version__}) has no {kind} device"
        elif device.index is not None and device.index >= count:
            why = f"only {count} {kind} device(s) here"
        else:  # torch's first sentence: its next ones can list every dispatch key
            first = (str(e).strip().splitlines() or [""])[0].split(". ")[0][:160]
            why = f"{type(e).__name__}: {first}".rstrip(": ")
        raise SpecError(f"--device {name}: {why} (available: {', '.join(_available_devices())})") from None


def _device_count(kind: str) -> int:
    """How many devices of a kind torch sees here (``torch.cuda``, ``torch.mps``, ``torch.xpu``...)."""
    import torch

    try:
        return int(getattr(torch, kind).device_count())
    except Exception:  # no such module, or a backend that cannot count
        return 0


def _available_devices() -> list[str]:
    found = ["cpu"]
    for kind in ("cuda", "mps", "xpu"):
        count = _device_count(kind)
        found += [kind] if count == 1 else [f"{kind}:{i}" for i in range(count)]
    return found


def _check_writable(path: str | None, what: str) -> None:
    """An output file is refused before the probe runs when it cannot be written: the probe's result
    would be lost at the end."""
    if not path:
        return
    target = Path(path)
    parent = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise SpecError(f"cannot write the {what} to {path!r}: it is a directory; give a file name")
    if not parent.is_dir():
        raise SpecError(f"cannot write the {what} to {path!r}: the directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise SpecError(f"cannot write the {what} to {path!r}: permission denied")


def _is_adapter(obj: Any) -> bool:
    from .trainer import TrainerAdapter

    return isinstance(obj, TrainerAdapter)


def _dtype(name: str | None) -> Any:
    import torch

    return None if name is None else getattr(torch, name)


def _report(
    fm: FlowMap,
    json_path: str | None,
    show_all: bool,
    html_path: str | None = None,
    markdown_path: str | None = None,
    extra: str = "",
) -> int:
    write_report(fm, sys.stdout, show_all=show_all)
    if extra:
        sys.stdout.write("\n" + visible(extra))
    if json_path:
        try:
            fm.to_json(json_path)
        except OSError as e:
            raise GradProbeError(f"cannot write the flow map to {json_path!r}: {e.strerror}") from None
        sys.stdout.write(f"\nflow map written to {json_path}\n")
    _write_reports(fm, html_path, markdown_path)
    return fm.exit_code


def _write_reports(fm: FlowMap, html_path: str | None, markdown_path: str | None) -> None:
    """Write the HTML and Markdown reports that were asked for, saying where."""
    from .report.html import render_html
    from .report.markdown import render_markdown

    for path, renderer, kind in (
        (html_path, render_html, "HTML"),
        (markdown_path, render_markdown, "Markdown"),
    ):
        if not path:
            continue
        try:
            Path(path).write_text(renderer(fm), encoding="utf-8")
        except OSError as e:
            raise GradProbeError(f"cannot write the {kind} report to {path!r}: {e.strerror}") from None
        sys.stdout.write(f"{kind} report written to {path}\n")


def _report_saved(args: argparse.Namespace) -> int:
    """``gradprobe report``: the terminal report, or the files asked for; exit status by findings."""
    fm = _failing(FlowMap.from_json(Path(args.flowmap)), args)
    if args.html or args.markdown:
        _write_reports(fm, args.html, args.markdown)
    else:
        write_report(fm, sys.stdout, show_all=args.all)
    return fm.exit_code


def _diff_saved(args: argparse.Namespace) -> int:
    """``gradprobe diff``: what changed between two flow maps; 1 if the flow changed, else 0."""
    from .flowdiff import diff_maps

    d = diff_maps(
        FlowMap.from_json(Path(args.before)), FlowMap.from_json(Path(args.after)), norm_rtol=args.norm_rtol
    )
    sys.stdout.write(d.render())
    return EXIT_FINDINGS if d.changed else EXIT_OK


STATUS_FILE_ENV = "GRADPROBE_STATUS_FILE"
DISTRIBUTED_ENV = "GRADPROBE_DISTRIBUTED"


def _is_rank() -> bool:
    """This process is a rank of ``gradprobe run --nproc N``: started by torch.distributed.run with
    ``GRADPROBE_DISTRIBUTED=1`` (set by the relaunch, or by hand around one's own torchrun command).
    Another program's torchrun environment inherited by a plain ``gradprobe run`` does not count."""
    return (
        os.environ.get(DISTRIBUTED_ENV) == "1"
        and "TORCHELASTIC_RUN_ID" in os.environ
        and "RANK" in os.environ
    )


def _without_nproc(argv: Sequence[str]) -> list[str]:
    """``argv`` less ``--nproc N``: the ranks know they are ranks from torchrun's environment, and
    torchrun's own parser would take ``--nproc`` for an abbreviation of its ``--nproc-per-node``."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a.startswith("--np") and "--nproc".startswith(a):
            skip = True
        elif not (a.startswith("--np") and "=" in a and "--nproc".startswith(a.split("=", 1)[0])):
            out.append(a)
    return out


def _relaunch(nproc: int, argv: Sequence[str]) -> int:
    """``gradprobe run ... --nproc N``: the same command in N ranks through torch.distributed.run.

    The ranks' output passes through; the exit status is rank 0's, which it leaves in a file (the
    ranks themselves exit 0 so that torchrun does not report them as failed).
    """
    import socket
    import subprocess
    import tempfile

    if nproc < 1:
        raise SpecError(f"--nproc must be at least 1, got {nproc}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="gradprobe-") as tmp:
        status = Path(tmp) / "status"
        env = {**os.environ, STATUS_FILE_ENV: str(status), DISTRIBUTED_ENV: "1"}
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "gradprobe", *_without_nproc(argv),
        ]  # fmt: skip
        sys.stdout.flush()
        rc = subprocess.run(cmd, env=env, check=False).returncode
        if status.is_file():
            return int(status.read_text().strip() or EXIT_USAGE)
    sys.stderr.write(
        f"gradprobe: error: the {nproc}-rank run failed before rank 0 finished "
        f"(torch.distributed.run exit status {rc})\n"
    )
    return EXIT_USAGE


def _distributed_run(args: argparse.Namespace, checks: list[str], diagnose: bool) -> int:
    """One rank of ``gradprobe run --nproc N``: every rank probes, rank 0 reports."""
    import torch
    import torch.distributed as dist

    from .distributed import attempt, gather_or_raise, init_from_env, probe_distributed
    from .report.ranks import render_ranks

    created = init_from_env()
    rank = dist.get_rank()
    code = EXIT_USAGE
    loaded = contextlib.ExitStack()  # the spec file stays importable while it is probed
    try:
        device = args.device
        if device is None and torch.cuda.is_available():
            device = f"cuda:{torch.cuda.current_device()}"
        spec, error = attempt(
            lambda: loaded.enter_context(
                load_spec(
                    args.target,
                    device=device,
                    dtype=_dtype(args.dtype),
                    rank=rank,
                    world_size=dist.get_world_size(),
                )
            )
        )
        if error is None and _is_adapter(spec):
            error = SpecError("a trainer adapter cannot be probed with --nproc: run it without")
        gather_or_raise(None, error, None)  # every rank stops if one cannot load the spec
        with _shown_if(args.verbose):
            fm = _failing(
                probe_distributed(
                    spec, variants=args.variants, reference=args.reference, diagnose=diagnose, checks=checks,
                    progress=not args.quiet,
                ),
                args,
            )  # fmt: skip
        if rank == 0:
            code = _report(fm, args.json, args.all, args.html, args.markdown, extra=render_ranks(fm))
        else:
            code = fm.exit_code
    except GradProbeError as e:
        if rank == 0:
            sys.stderr.write(visible(f"gradprobe: error: {e}\n"))
        code = EXIT_USAGE
    finally:
        loaded.close()
        status = os.environ.get(STATUS_FILE_ENV)
        if rank == 0 and status:
            Path(status).write_text(f"{code}\n")
        if created and dist.is_initialized():
            dist.destroy_process_group()
    if os.environ.get(STATUS_FILE_ENV):
        # A rank of gradprobe's own --nproc launch (rank 0's code is in the status file): nothing of the
        # user's lives on in this process. It leaves without interpreter finalization, where gloo's
        # threads sometimes aborted the rank after its work was done ("terminate called without an
        # active exception", 1 run in about 10 on 2 cores, old code too), failing the whole launch.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_OK)
    return code


def _shown_if(verbose: bool) -> contextlib.AbstractContextManager[Any]:
    """``-v``: torch's warnings and logging during the probe go to stderr, as without gradprobe."""
    return shown() if verbose else contextlib.nullcontext()


def _checks(given: Sequence[str]) -> list[str]:
    """``--check a,b --check c``: every name once, in the order given."""
    names = [c.strip() for option in given for c in option.split(",") if c.strip()]
    return list(dict.fromkeys(names))


def _cli_expect(given: Sequence[str]) -> dict[str, dict[str, list[str]]]:
    """``--expect 'force only=fitting,descriptor' --expect 'energy only!=aux'`` as expect= data."""
    out: dict[str, dict[str, list[str]]] = {}
    for option in given:
        negated = "!=" in option
        scenario, sep, prefixes = option.partition("!=" if negated else "=")
        names = [p.strip() for p in prefixes.split(",") if p.strip()]
        if not sep or not scenario.strip() or not names:
            raise SpecError(
                f"--expect {option!r}: write SCENARIO=PREFIX[,PREFIX] (must reach) or SCENARIO!=PREFIX "
                "(must not reach), e.g. --expect 'force only=fitting'"
            )
        entry = out.setdefault(scenario.strip(), {"reaches": [], "not_reaches": []})
        entry["not_reaches" if negated else "reaches"].extend(names)
    return out


def _with_expect(
    declared: Any, extra: Mapping[str, Mapping[str, list[str]]]
) -> dict[str, dict[str, list[str]]]:
    """The spec's expect= with the command line's declarations added (scenario by scenario)."""
    from .declarations import KINDS, normalized_expect

    merged = normalized_expect(declared)
    for scenario, entry in extra.items():
        mine = merged.setdefault(scenario, {k: [] for k in KINDS})
        for kind in KINDS:
            mine[kind] = list(dict.fromkeys([*mine[kind], *entry.get(kind, [])]))
    return merged


def _probe_command(args: argparse.Namespace, checks: list[str]) -> FlowMap:
    """``demo`` and ``run``: build the spec (or adapter) and probe it."""
    if args.command == "demo":
        from .zoo import reference_spec
        from .zoo.bugs import BUGS

        with stage("the reference potential"):
            spec = reference_spec(
                device=args.device,
                dtype=_dtype(args.dtype),
                mode=args.mode,
                with_virial=not args.no_virial,
                seed=args.seed,
                bug=args.bug,
            )
        if args.bug is None:
            return _probe_spec(args, spec, checks, args.diagnose)
        return _probe_spec(args, spec, list(dict.fromkeys([*checks, *BUGS[args.bug].checks])), True)
    with contextlib.ExitStack() as loaded:  # the spec file stays importable while it is probed
        with stage(f"loading {args.target}"):
            spec = loaded.enter_context(load_spec(args.target, device=args.device, dtype=_dtype(args.dtype)))
        return _probe_spec(args, spec, checks, args.diagnose)


def _probe_spec(args: argparse.Namespace, spec: Any, checks: list[str], diagnose: bool) -> FlowMap:
    from .probe import probe

    expect = _cli_expect(args.expect)
    if _is_adapter(spec):
        from .trainer import parse_configurations, probe_trainer

        if args.reference:
            raise SpecError("a trainer adapter's reference is its first configuration: drop --reference")
        configurations, knobs = parse_configurations(spec, args.variants)
        fields = {"expect": _with_expect(getattr(spec, "expect", None), expect)} if expect else {}
        return probe_trainer(
            spec, configurations=configurations, knobs=knobs, diagnose=diagnose, checks=checks, **fields
        )
    if expect:
        spec = dataclasses.replace(spec, expect=_with_expect(spec.expect, expect))
    return probe(spec, variants=args.variants, reference=args.reference, diagnose=diagnose, checks=checks)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        for option, what in (
            ("json", "JSON flow map"),
            ("html", "HTML report"),
            ("markdown", "Markdown report"),
        ):
            _check_writable(getattr(args, option, None), what)
        _check_device(getattr(args, "device", None))
        if args.command == "run" and args.nproc is not None and not _is_rank():
            return _relaunch(args.nproc, argv)
        if args.command == "report":
            return _report_saved(args)
        if args.command == "diff":
            return _diff_saved(args)
        checks = _checks(args.check)
        if args.command == "run" and _is_rank():
            return _distributed_run(args, checks, args.diagnose)
        if args.command == "demo" and args.bug == "list":
            from .zoo.bugs import BUGS

            width = max(map(len, BUGS))
            for bug in BUGS.values():
                sys.stdout.write(f"{bug.id.ljust(width)}  {bug.description} (variants: {bug.variants})\n")
            return EXIT_OK
        # One reporter for the whole command: loading a trainer's model can take as long as probing it.
        from .evidence import compiler_passes

        with (
            reporting(not args.quiet),
            compiler_passes.enabled(args.compiler_bisect),
            _shown_if(args.verbose),
        ):
            fm = _failing(_probe_command(args, checks), args)
        return _report(fm, args.json, args.all, args.html, args.markdown)
    except GradProbeError as e:
        sys.stderr.write(visible(f"gradprobe: error: {e}\n"))
        return EXIT_USAGE
    except Exception as e:  # gradprobe's own failure: a symptom of the user's model is a recorded finding
        return crashed(e, args.verbose)


if __name__ == "__main__":
    raise SystemExit(main())
