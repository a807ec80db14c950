"""Probe MACE's own training path: the eager model vs ``mace.tools.compile.prepare`` + ``torch.compile``.

    python3 -m venv .venv-mace && .venv-mace/bin/pip install -c constraints.txt -e . 'mace-torch==0.3.16'
    .venv-mace/bin/python examples/mace_probe.py --backend aot_eager   # a tiny synthetic frame; seconds
    .venv-mace/bin/python examples/mace_probe.py --plain-compile       # also torch.compile of the model

mace-torch 0.3.16 pins e3nn 0.4.4 (NequIP needs 0.6): give it an environment of its own. Terms are
MACE's energy, forces and stress losses; the compiled path is MACE's ``prepare(factory)`` model loaded
with the probed parameters, so both paths share them. ``--plain-compile`` shows what a plain
``torch.compile(model)`` does: energy trains compiled, forces name the double backward and its line.
"""

from __future__ import annotations

import argparse

import gradprobe
from gradprobe import render
from gradprobe.adapters.mace import MaceAdapter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    parser.add_argument("--diagnose", action="store_true", help="bisect the compiled path's knobs")
    parser.add_argument(
        "--plain-compile", action="store_true", help="also probe torch.compile of the model alone"
    )
    args = parser.parse_args(argv)

    adapter = MaceAdapter.tiny()
    fm = adapter.probe(backend=args.backend, diagnose=args.diagnose)
    print(render(fm))
    if not args.plain_compile:
        return fm.exit_code
    plain = gradprobe.probe(
        adapter.module(), adapter.terms_of, adapter.batch(), variants=f"eager,compile_model:{args.backend}",
        diagnose=args.diagnose,
    )  # fmt: skip
    print(render(plain))
    # The plain compile is expected to fail on forces (double backward): report it, exit by the
    # package's own path.
    return fm.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
