#!/usr/bin/env bash
# Install the third-party packages the tests marked real_packages probe (issue 16): NequIP 0.19 (e3nn
# 0.6), SchNetPack 2.1, TorchANI 2.9 and transformers, against the torch already installed (CPU,
# constraints.txt). Nothing downloads weights or data at test time: the tests build tiny systems.
#
# SchNetPack 2.1 pins sympy<=1.12 (torch 2.13 needs a newer one) and pulls tensorboard, black and
# pre-commit it does not import: it is installed without its dependencies, plus those it imports.
set -euo pipefail
cd "$(dirname "$0")/.."
pip install -q -c constraints.txt 'nequip==0.19.1' 'e3nn==0.6.0' 'torchani==2.9.0' 'transformers>=4.40,<6'
pip install -q -c constraints.txt --no-deps 'schnetpack==2.1.1'
pip install -q -c constraints.txt 'ase>=3.21' h5py pyyaml 'hydra-core>=1.1' 'pytorch-lightning>=2' torchmetrics \
    rich fasteners dirsync torch-ema 'matscipy>=1.1' tqdm
python - <<'PY'
import importlib

import torch.utils.data.dataloader as dl

if not hasattr(dl, "T_co"):  # torch 2.13 renamed it; SchNetPack imports the old name (see its test)
    dl.T_co = dl._T_co
for name in ("nequip", "e3nn", "schnetpack", "torchani", "transformers"):
    module = importlib.import_module(name)
    print(name, getattr(module, "__version__", "?"))
PY
