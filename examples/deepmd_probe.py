"""Probe DeePMD-kit's own training paths: uncompiled vs ``enable_compile``, term by term.

    pip install 'gradprobe[deepmd]'      # deepmd-kit 3.2 (see the README to build it against your torch)
    python examples/deepmd_probe.py                         # a tiny synthetic se_e2_a system, inductor
    python examples/deepmd_probe.py --backend aot_eager     # quicker: DeePMD's trace, another backend
    python examples/deepmd_probe.py --detach keep --diagnose   # the bug stripping guards against
    python examples/deepmd_probe.py --input input.json      # your own DeePMD input (its data paths)

The first compiled run costs a minute or two with inductor on a laptop CPU (cold cache).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from gradprobe import render
from gradprobe.adapters.deepmd import DeepmdAdapter, se_e2_a_config, write_synthetic_system


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", help="a DeePMD input JSON (default: a tiny synthetic se_e2_a system)")
    parser.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    parser.add_argument("--detach", default="strip", choices=["strip", "keep"])
    parser.add_argument("--diagnose", action="store_true", help="bisect the compiled path's knobs")
    parser.add_argument("--html", help="also write the HTML report here")
    args = parser.parse_args(argv)

    if args.input:
        config = json.loads(Path(args.input).read_text())
    else:
        work = Path(tempfile.mkdtemp(prefix="gradprobe-deepmd-example-"))
        config = se_e2_a_config(write_synthetic_system(work / "system"), workdir=work)
    adapter = DeepmdAdapter.from_config(config)
    for change in adapter.changes:
        print(f"note: {change}")
    fm = adapter.probe(backend=args.backend, detach=args.detach, diagnose=args.diagnose)
    print(render(fm))
    if args.html:
        from gradprobe.report.html import render_html

        Path(args.html).write_text(render_html(fm), encoding="utf-8")
    return fm.exit_code


if __name__ == "__main__":
    sys.exit(main())
