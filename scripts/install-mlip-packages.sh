#!/usr/bin/env bash
# Install SevenNet 0.13, torchmd-net 3.1 and matgl 4.1.2 (issue 33: the generic potential adapter's
# real-package tests) into the active environment, against the torch already installed (CPU,
# constraints.txt). They bring torch_geometric, ase, pymatgen and NVIDIA warp (torchmd-net's and matgl's
# kernels, compiled for the CPU on first use, about 25 s, then cached). SevenNet-0 ships in sevenn's
# wheel; nothing downloads weights or data at test time: the tests build tiny random systems.
# Measured on 2 cores: about 2 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
pip install -q -c constraints.txt -e '.[test,mlip]'
python - <<'PY'
import importlib

for name in ("sevenn", "torchmdnet", "matgl", "torch_geometric"):
    module = importlib.import_module(name)
    print(name, getattr(module, "__version__", "?"))
PY
