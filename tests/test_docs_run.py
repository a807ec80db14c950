"""The README's and docs' examples are run, and what they show is what the tool prints (issue 34).

Every fenced block of README.md and docs/*.md carries a marker, an HTML comment on the line right
above its opening fence (invisible on GitHub), which says how the block is checked:

- ``<!-- docs-test: output of CMD -->``: the block is the whole of what ``CMD`` prints on stdout;
- ``<!-- docs-test: excerpt of the output of CMD -->``: a line ``...`` stands for lines left out
  (at the start, in between or at the end); the lines between two ``...`` are consecutive lines of the
  output, in order; a line ending in `` ...`` is cut: the output's line starts with it;
- either may end in ``(exit N)``: the command's exit status (default 0);
- ``<!-- docs-test: run -->``: a Python block run as a script, as pasted (``run, continued``: after the
  file's previous ``run`` blocks, in one script, so it may use their names);
- ``<!-- docs-test: pytest -->``: a Python block written to a test file, on which pytest passes;
- ``<!-- docs-test: skip (REASON) -->``: not run, for the stated reason.

``CMD`` is a ``gradprobe ...`` command line, which must appear verbatim in a ``bash`` block earlier in the
same section (that block needs no marker of its own; its other ``gradprobe`` lines are run and must exit
0). Commands run in a temporary directory (with the repository's ``examples/`` in it) through
``python -m gradprobe``, stdout piped. Before comparing, both texts are normalised: runs of blanks are one
blank, timings (``4.8s``, ``1.1 s``, ``12 ms``) and memory addresses are placeholders, absolute paths
are their last component, and numbers are compared as numbers: integers exactly, others within 5%
relative, and any two below 1e-9 in magnitude are equal (``0`` vs ``1.2e-15``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!--\s*docs-test:\s*(.*?)\s*-->\s*$")
OUTPUT = re.compile(r"^(output|excerpt) of (?:the output of )?(gradprobe .*?)(?:\s+\(exit (\d+)\))?$")
FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)\s*$")
TIMEOUT = 240


@dataclasses.dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    marker: str | None
    section: int  # index of the heading the block is under
    heading: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def id(self) -> str:
        """A test id that survives edits above the block: the page and the command or the heading."""
        m = OUTPUT.match(self.marker or "")
        return f"{self.page.name}: {m.group(2)[:70] if m else self.heading}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, with the marker right above each."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    section, heading, i = 0, "", 0
    while i < len(lines):
        if lines[i].startswith("#"):
            section, heading = section + 1, lines[i].lstrip("#").strip()
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == m.group(1))
        above = MARKER.match(lines[i - 1]) if i else None
        out.append(
            Block(
                page,
                i + 1,
                m.group(2),
                "\n".join(lines[i + 1 : end]),
                above and above.group(1),
                section,
                heading,
            )
        )
        i = end + 1
    return out


ALL = [b for page in PAGES for b in blocks(page)]


def _command_block(block: Block, command: str) -> Block:
    """The bash block earlier in the same section that shows ``command``."""
    earlier = [
        b
        for b in ALL
        if b.page == block.page and b.section == block.section and b.line < block.line and b.lang == "bash"
    ]
    for b in reversed(earlier):
        if command in b.text:
            return b
    raise AssertionError(f"{block.where}: the command {command!r} is shown in no bash block above it")


def _checked(kind: str) -> list[Block]:
    return [b for b in ALL if b.marker and b.marker.split(maxsplit=1)[0].rstrip(",") == kind]


# ---- normalising and comparing printed text ------------------------------------------------------

TIME = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?(?:ms|s)\b")
ADDRESS = re.compile(r"\b0x[0-9a-fA-F]+\b")
PATH = re.compile(r"(?<![\w.~])(?:/[\w.+-]+)+/(?=[\w.+-])")
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?%?")


def normalise(line: str) -> list[str]:
    """A line as alternating text and number tokens (text first), timings, addresses and paths replaced."""
    line = " ".join(line.split())
    line = TIME.sub("<time>", line)
    line = ADDRESS.sub("<address>", line)
    line = PATH.sub("", line)
    tokens, pos = [], 0
    for m in NUMBER.finditer(line):
        tokens += [line[pos : m.start()], m.group()]
        pos = m.end()
    return [*tokens, line[pos:]]


def _same_number(a: str, b: str) -> bool:
    if a.endswith("%") != b.endswith("%"):
        return False
    x, y = float(a.rstrip("%")), float(b.rstrip("%"))
    if not any(c in s for s in (a, b) for c in ".eE%"):
        return x == y  # integers: counts, line numbers, sizes
    return (abs(x) < 1e-9 and abs(y) < 1e-9) or abs(x - y) <= 0.05 * max(abs(x), abs(y))


def same_line(shown: str, printed: str) -> bool:
    """``shown`` (a README line) says what ``printed`` says; `` ...`` at its end: ``printed`` starts so."""
    cut = shown.rstrip().endswith(" ...")
    a = normalise(shown.rstrip()[:-4] if cut else shown)
    b = normalise(printed)
    if len(a) > len(b) or (not cut and len(a) != len(b)):
        return False
    for k, (x, y) in enumerate(zip(a, b, strict=False)):
        if k % 2:
            if not _same_number(x, y):
                return False
        elif k == len(a) - 1 and cut:
            if not y.startswith(x):
                return False
        elif x != y:
            return False
    return True


def _chunks(shown: list[str]) -> list[list[str]]:
    chunks: list[list[str]] = [[]]
    for line in shown:
        if line.strip() == "...":
            chunks.append([])
        else:
            chunks[-1].append(line)
    return chunks


def mismatch(shown_text: str, printed_text: str, *, excerpt: bool) -> str | None:
    """None when the shown block matches the printed output, else what does not."""
    shown, printed = shown_text.splitlines(), printed_text.rstrip("\n").splitlines()
    if not excerpt:
        if any(line.strip() == "..." for line in shown):
            return "an `output` block leaves lines out (`...`): mark it `excerpt of the output of`"
        if any(line.rstrip().endswith(" ...") for line in shown):
            return "an `output` block cuts a line (` ...`): mark it `excerpt of the output of`"
        chunks = [shown]
    else:
        chunks = _chunks(shown)
        if len(chunks) == 1 and not any(line.rstrip().endswith(" ...") for line in shown):
            return "an `excerpt` block leaves nothing out: mark it `output of`"
    pos = 0
    for k, chunk in enumerate(chunks):
        anchored_start, anchored_end = k == 0, k == len(chunks) - 1
        if not chunk:
            continue
        starts = [pos] if anchored_start else list(range(pos, len(printed)))
        # The longest run of the chunk's lines that match from some start: where it stops is the news.
        best, best_start = -1, pos
        for s in starts:
            n = 0
            while n < len(chunk) and s + n < len(printed) and same_line(chunk[n], printed[s + n]):
                n += 1
            if n == len(chunk) and (not anchored_end or s + n == len(printed)):
                best = None
                pos = s + n
                break
            if n > best:
                best, best_start = n, s
        if best is None:
            continue
        if best == len(chunk):
            problem = "the output goes on after these lines (a `...` line says that lines are left out)"
        elif best_start + best < len(printed):
            problem = f"shown: {chunk[best]!r}\nprinted: {printed[best_start + best]!r}"
        else:
            problem = f"shown: {chunk[best]!r}\nthe output ends before it"
        return (
            f"lines {'from the start of the output' if anchored_start else 'after the previous part'}"
            f" differ from what is printed:\n{problem}\n---- the command printed ----\n{printed_text}"
        )
    return None


@pytest.mark.parametrize(
    ("shown", "printed", "same"),
    [
        ("max rel. error 0", "max rel. error 1.2e-15", True),
        ("rel. error up to 1.7", "rel. error up to 2.2", False),
        ("force only: 10/14", "force only: 8/14", False),
        ("compile:eager: 4.8s, compiled 1x", "compile:eager: 12.1s, compiled 1x", True),
        ("done in 1.1 s", "done in 35 s", True),
        ("at potential.py:73", "at /tmp/x/y/potential.py:73", True),
        ("at potential.py:73", "at potential.py:74", False),
        ("<object at 0x7f3a>", "<object at 0x55d1c0>", True),
        ("off by up to 166%", "off by up to 167%", True),
        ("a   b", "a b", True),
        (
            "force only: 4 not reached: energy_shift ...",
            "force only: 4 not reached: energy_shift (x); y",
            True,
        ),
        ("force only: 4 not reached: aux ...", "force only: 4 not reached: energy_shift (x); y", False),
        ("no force/virial gradient", "no force/virial gradient", True),
    ],
)
def test_normalisation(shown, printed, same):
    assert same_line(shown, printed) is same


def test_excerpts_keep_order_and_place():
    printed = "a\nb\nc\nd"
    assert mismatch("a\nb\nc\nd", printed, excerpt=False) is None
    assert mismatch("a\nb\n...\nd", printed, excerpt=True) is None
    assert mismatch("...\nb\nc\n...", printed, excerpt=True) is None
    assert mismatch("a\nc\n...", printed, excerpt=True) is not None  # a and c are not consecutive
    assert mismatch("...\nc\n...\nb\n...", printed, excerpt=True) is not None  # order
    assert mismatch("b\nc\n...", printed, excerpt=True) is not None  # the start is the output's start
    assert mismatch("a\nb\nc", printed, excerpt=False) is not None  # d left out without saying so


# ---- the pages' blocks -----------------------------------------------------------------------------


def test_every_block_says_how_it_is_checked():
    """A block without a marker is only a bash block whose command an output marker below names."""
    named = {(_command_block(b, m.group(2)).where) for b in ALL if b.marker and (m := OUTPUT.match(b.marker))}
    unmarked = [b.where for b in ALL if not b.marker and b.where not in named]
    assert not unmarked, f"fenced blocks without a `<!-- docs-test: ... -->` marker: {unmarked}"
    kinds = {"output", "excerpt", "run", "pytest", "skip"}
    unknown = [
        f"{b.where}: {b.marker}" for b in ALL if b.marker and b.marker.split()[0].rstrip(",") not in kinds
    ]
    assert not unknown, f"markers of no known kind: {unknown}"
    bad = [
        f"{b.where}: {b.marker}"
        for b in _checked("output") + _checked("excerpt")
        if not OUTPUT.match(b.marker)
    ]
    assert not bad, f"output markers that name no `gradprobe ...` command: {bad}"
    unexplained = [b.where for b in _checked("skip") if not re.match(r"skip \(.+\)$", b.marker)]
    assert not unexplained, f"skip markers without a reason in parentheses: {unexplained}"
    # The blocks may not be exempt.
    readme = [b for b in ALL if b.page.name == "README.md"]
    covered = {b.marker for b in readme if b.marker and not b.marker.startswith("skip")}
    for needed in ("gradprobe demo", "--variants", "--bug makefx-detach"):
        assert any(OUTPUT.match(m) and needed in m for m in covered), needed
    assert any(b.marker == "pytest" and "assert_grad_flow" in b.text for b in readme)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "FORCE_COLOR")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env["NO_COLOR"] = "1"
    return env


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    return tmp_path


def _gradprobe(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    argv = shlex.split(command)
    assert argv[0] == "gradprobe", command
    return _run([sys.executable, "-m", "gradprobe", *argv[1:]], cwd)


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run in a session of its own: on a timeout the whole session goes (the ranks of ``--nproc`` too)."""
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"`{shlex.join(argv)}` ran past {TIMEOUT} s:\n{out}\n{err[-4000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


OUTPUT_BLOCKS = [b for b in ALL if b.marker and OUTPUT.match(b.marker)]
# Commands that compile, bisect or launch ranks: 15-20 s of CPU each, a minute on a loaded 2-core machine.
SLOW = ("--variants", "--bug", "--nproc")


def _params(blocks: list[Block]) -> list[object]:
    slow = [pytest.mark.slow]
    return [
        pytest.param(
            b, id=b.id, marks=slow if b.marker == "pytest" or any(s in b.marker for s in SLOW) else ()
        )
        for b in blocks
    ]


@pytest.mark.parametrize("block", _params(OUTPUT_BLOCKS))
def test_output_block_is_what_the_command_prints(block, workdir):
    kind, command, status = OUTPUT.match(block.marker).groups()
    shown_in = _command_block(block, command)
    done = _gradprobe(command, workdir)
    assert done.returncode == int(status or 0), (
        f"{block.where}: `{command}` exited {done.returncode}\n{done.stderr}"
    )
    problem = mismatch(block.text, done.stdout, excerpt=kind == "excerpt")
    assert problem is None, f"{block.where} (`{command}`, shown at {shown_in.where}): {problem}"
    others = [
        line.strip()
        for line in shown_in.text.splitlines()
        if line.strip().startswith("gradprobe ")
        and line.strip() != command
        and not any(OUTPUT.match(b.marker).group(2) == line.strip() for b in OUTPUT_BLOCKS)
    ]
    for other in others:
        ran = _gradprobe(other, workdir)
        assert ran.returncode == 0, f"{shown_in.where}: `{other}` exited {ran.returncode}\n{ran.stderr}"


def _script(block: Block) -> str:
    if not block.marker.startswith("run, continued"):
        return block.text
    earlier = [b for b in _checked("run") if b.page == block.page and b.line < block.line]
    return "\n\n".join(b.text for b in [*earlier, block])


RUN_BLOCKS = _checked("run")


@pytest.mark.parametrize("block", _params(RUN_BLOCKS))
def test_python_block_runs_as_pasted(block, workdir):
    assert block.lang == "python", block.where
    script = workdir / "example.py"
    script.write_text(_script(block) + "\n", encoding="utf-8")
    done = _run([sys.executable, str(script)], workdir)
    assert done.returncode == 0, f"{block.where} raised:\n{done.stderr[-4000:]}"


PYTEST_BLOCKS = _checked("pytest")


@pytest.mark.parametrize("block", _params(PYTEST_BLOCKS))
def test_pytest_block_passes_as_pasted(block, workdir):
    """As the README says: the first run writes the snapshot (``--gradprobe-update``), later runs compare."""
    assert block.lang == "python", block.where
    (workdir / "test_from_docs.py").write_text(block.text + "\n", encoding="utf-8")

    def pytest_(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_from_docs.py", *args]
        return _run(argv, workdir)

    first = pytest_("--gradprobe-update")
    assert first.returncode == 0, f"{block.where}:\n{first.stdout[-4000:]}"
    snapshots = re.findall(r"^def (test_\w+)\([^)]*\bgradprobe_snapshot\b", block.text, flags=re.M)
    if snapshots:  # those tests again, now comparing with the snapshots just written
        again = pytest_("-k", " or ".join(snapshots))
        assert again.returncode == 0, f"{block.where}, with the snapshot written:\n{again.stdout[-4000:]}"


# ---- what the README says about the catalogue and the command line -----------------------------------


def _catalogue() -> set[str]:
    """Every cause id: each cause module's ``CAUSE`` and the ids of docs/causes.md's severity table."""
    import importlib
    import pkgutil

    import gradprobe.causes as causes

    ids = set()
    for info in pkgutil.iter_modules(causes.__path__):
        cause = getattr(importlib.import_module(f"gradprobe.causes.{info.name}"), "CAUSE", None)
        if cause:
            ids.add(cause)
    return ids | _severity_table()


def _severity_table() -> set[str]:
    text = (ROOT / "docs" / "causes.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| (?:error|warning|info) \|(.*)\|$", text, flags=re.M)
    return {i for row in rows for i in re.findall(r"`([a-z]+(?:-[a-z]+)+)`", row)}


def test_readme_lists_every_cause_of_the_catalogue():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    listed = re.search(r"Causes recognised:(.*?)Severities:", readme, flags=re.S)
    assert listed, "README's `Causes recognised:` list is gone"
    named = set(re.findall(r"`([a-z]+(?:-[a-z]+)+)`", listed.group(1)))
    assert _catalogue() - named == set(), "causes missing from README's list"
    assert named - _catalogue() == set(), "README lists causes the catalogue does not have"


def test_causes_doc_gives_every_cause_a_severity():
    import importlib
    import pkgutil

    import gradprobe.causes as causes

    modules = {
        getattr(importlib.import_module(f"gradprobe.causes.{m.name}"), "CAUSE", None)
        for m in pkgutil.iter_modules(causes.__path__)
    } - {None}
    assert modules - _severity_table() == set()


def test_report_exit_status_is_in_the_readme_and_the_help():
    """Issue 34 item 7: ``gradprobe report`` exits 1 on a map with errors; --help and the README say so."""
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert "`gradprobe report` renders a saved flow map and exits as the run that wrote it would" in readme
    assert "**1** it holds some" in readme
    done = _run([sys.executable, "-m", "gradprobe", "report", "--help"], ROOT)
    assert "1 it holds error findings" in " ".join(done.stdout.split())
