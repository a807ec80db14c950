"""The layers' direction, read from the import statements of ``src/gradprobe`` (``ast``, lazy imports
inside functions included), as docs/architecture.md draws it:

    spec -> probe -> variants/build -> measure -> FlowMap -> evidence -> diagnose (causes/) -> report/

* the flow map is plain data: ``flowmap.py`` imports nothing from gradprobe but ``errors`` and ``status``;
* renderers read a flow map only: ``report/*`` imports ``flowmap``, ``status``, ``declarations`` (the
  notes' wording), ``wording`` and ``report/`` itself;
* detectors read a flow map only: ``causes/*`` and ``diagnose`` import ``flowmap``, ``status``,
  ``compare`` (the verdict names), ``declarations``, ``variants`` (backend names), ``wording`` and
  ``causes/`` itself;
* what measures and gathers evidence never looks downstream: it imports no detector, no renderer and no
  orchestrator (``probe``, ``distributed``, ``trainer``, ``testing``, ``cli``, ``adapters/``);
* no module imports a ``_private`` name from another gradprobe module, nor reads one as an attribute of
  a gradprobe module it imported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "gradprobe"

FLOWMAP_MAY_IMPORT = {"gradprobe.errors", "gradprobe.status"}
REPORT_MAY_IMPORT = {
    "gradprobe.flowmap",
    "gradprobe.status",
    "gradprobe.declarations",
    "gradprobe.wording",
    "gradprobe.claims",
    "gradprobe.frames",  # which file names are the user's (a saved "where" inside importlib is never shown)
}
CAUSES_MAY_IMPORT = {
    "gradprobe.flowmap",
    "gradprobe.status",
    "gradprobe.compare",
    "gradprobe.declarations",
    "gradprobe.variants",
    "gradprobe.wording",
    "gradprobe.claims",  # the predicates a finding's claims are checked with
}
# Downstream of the measurement: the detectors, the renderers and what runs a whole probe.
DOWNSTREAM = ("gradprobe.causes", "gradprobe.diagnose", "gradprobe.report", "gradprobe.adapters")
ORCHESTRATORS = {
    "gradprobe",
    "gradprobe.__main__",
    "gradprobe.cli",
    "gradprobe.probe",
    "gradprobe.distributed",
    "gradprobe.trainer",
    "gradprobe.testing",
    "gradprobe.flowdiff",  # a reader of two maps, beside the renderers
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (SRC / rel).with_suffix(".py").is_file() or (SRC / rel / "__init__.py").is_file()


def _imports(path: Path) -> Iterator[tuple[int, str, str | None]]:
    """(line, module imported, name imported from it or None) for every gradprobe import of ``path``.
    ``from . import x`` of a submodule ``x`` is the module ``pkg.x``."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "gradprobe":
                    yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            if module.split(".")[0] != "gradprobe":
                continue
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                if _is_module(sub):
                    yield node.lineno, sub, None
                else:
                    yield node.lineno, module, alias.name


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _violations(may_import: set[str], own: str, modules: list[Path]) -> list[str]:
    return [
        f"{p.relative_to(SRC)}:{line} imports {module}"
        for p in modules
        for line, module, _ in _imports(p)
        if module not in may_import and not _within(module, own)
    ]


def test_the_flow_map_is_plain_data() -> None:
    bad = _violations(FLOWMAP_MAY_IMPORT, "gradprobe.flowmap", [PACKAGE / "flowmap.py"])
    assert not bad, (
        f"flowmap.py may import from gradprobe only {sorted(FLOWMAP_MAY_IMPORT)} (the map is plain data, "
        f"read by every later stage): {bad}"
    )


def test_renderers_read_a_flow_map_only() -> None:
    bad = _violations(REPORT_MAY_IMPORT, "gradprobe.report", sorted((PACKAGE / "report").glob("*.py")))
    assert not bad, (
        f"report/* may import only {sorted(REPORT_MAY_IMPORT)} and report/ itself: renderers read a "
        f"FlowMap and compute nothing new (no cause, no evidence collector, no probe): {bad}"
    )


def test_detectors_read_a_flow_map_only() -> None:
    modules = [*sorted((PACKAGE / "causes").glob("*.py")), PACKAGE / "diagnose.py"]
    bad = _violations(CAUSES_MAY_IMPORT, "gradprobe.causes", modules)
    assert not bad, (
        f"causes/* and diagnose.py may import only {sorted(CAUSES_MAY_IMPORT)} and causes/ itself: "
        f"detectors read the flow map's evidence (no report/, probe, measure, build, evidence/): {bad}"
    )


def test_measurement_and_evidence_never_look_downstream() -> None:
    upstream = [
        p
        for p in _sources()
        if _module_name(p) not in ORCHESTRATORS and not any(_within(_module_name(p), d) for d in DOWNSTREAM)
    ]
    assert any(_module_name(p) == "gradprobe.evidence.collect" for p in upstream)
    bad = [
        f"{p.relative_to(SRC)}:{line} imports {module}"
        for p in upstream
        for line, module, _ in _imports(p)
        if module in ORCHESTRATORS or any(_within(module, d) for d in DOWNSTREAM)
    ]
    assert not bad, (
        f"the measurement and the evidence (every module but {sorted(ORCHESTRATORS)} and "
        f"{', '.join(d + '*' for d in DOWNSTREAM)}) may not import a detector, a renderer or an "
        f"orchestrator: the layers go one way, spec -> probe -> measure -> FlowMap -> diagnose -> report: {bad}"
    )


def test_no_private_name_crosses_a_module() -> None:
    bad = []
    for p in _sources():
        modules: set[str] = set()  # local names bound to gradprobe modules
        for line, module, name in _imports(p):
            if name is not None and name.startswith("_") and not name.startswith("__"):
                bad.append(f"{p.relative_to(SRC)}:{line} imports {name} from {module}")
        tree = ast.parse(p.read_text(), str(p))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (
                node.level or (node.module or "").startswith("gradprobe")
            ):
                modules.update(a.asname or a.name for a in node.names)
            elif isinstance(node, ast.Import):
                modules.update(a.asname or a.name for a in node.names if a.name.startswith("gradprobe"))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in modules
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                bad.append(f"{p.relative_to(SRC)}:{node.lineno} reads {node.value.id}.{node.attr}")
    assert not bad, (
        "no module imports a _private name from another gradprobe module or reads one as an attribute: "
        f"make it public where it is shared, or move it: {bad}"
    )


def test_the_reader_sees_relative_submodule_and_lazy_imports() -> None:
    def seen(path: str) -> set[tuple[str, str | None]]:
        return {(m, n) for _, m, n in _imports(PACKAGE / path)}

    assert ("gradprobe.flowmap", "FlowMap") in seen("report/terminal.py")
    assert ("gradprobe.causes.backend_drops", None) in seen(
        "causes/__init__.py"
    )  # from . import backend_drops
    assert ("gradprobe.evidence.collect", None) in seen("probe.py")  # inside _gather_evidence
