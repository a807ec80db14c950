"""Probe NequIP's own training paths: the eager GraphModel vs ``compile_mode="compile"``, term by term.

    pip install nequip                                     # nequip 0.19 (e3nn 0.6)
    python examples/nequip_probe.py --backend aot_eager    # a tiny synthetic system; about half a minute
    python examples/nequip_probe.py                        # NequIP's own inductor (a minute or two cold)
    python examples/nequip_probe.py --plain-compile        # also torch.compile of the model (compile_model)

Terms come from NequIP's own EnergyForceStressLoss; the compiled path is NequIP's CompileGraphModel
around the same network, so both share the probed parameters.
"""

from __future__ import annotations

import argparse

import gradprobe
from gradprobe import render
from gradprobe.adapters.nequip import NequipAdapter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    parser.add_argument("--diagnose", action="store_true", help="bisect the compiled path's knobs")
    parser.add_argument(
        "--plain-compile",
        action="store_true",
        help="also probe torch.compile of the model alone (what `torch.compile(model)` does)",
    )
    args = parser.parse_args(argv)

    adapter = NequipAdapter.tiny()
    fm = adapter.probe(backend=args.backend, diagnose=args.diagnose)
    print(render(fm))
    if args.plain_compile:
        plain = gradprobe.probe(
            adapter.module(),
            adapter.terms_of,
            adapter.batch(),
            variants=f"eager,compile_model:{args.backend}",
            diagnose=args.diagnose,
        )
        print(render(plain))
        return max(fm.exit_code, plain.exit_code)
    return fm.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
