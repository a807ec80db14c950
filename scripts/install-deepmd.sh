#!/usr/bin/env bash
# Install deepmd-kit 3.2.0 (pt_expt backend, no TensorFlow) built from its sdist against the torch
# already installed: the prebuilt wheel's C++ op library targets torch 2.11 and refuses to load on
# 2.13. About 3-4 minutes on 2 cores. Do not use deepmd-kit's [torch] extra: it pins another torch;
# install what that extra adds by hand: e3nn, which deepmd.pt imports (its sezm descriptor) and the
# backends check (pt against pt_expt) needs. 0.6.0 is also NequIP's (scripts/install-real-packages.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
pip install -q -c constraints.txt 'scikit-build-core>=1' packaging dependency_groups hatch-fancy-pypi-readme \
    setuptools_scm cmake ninja
DP_ENABLE_TENSORFLOW=0 DP_ENABLE_PYTORCH=1 DP_VARIANT=cpu \
    pip install -q -c constraints.txt --no-build-isolation --no-binary deepmd-kit 'deepmd-kit==3.2.0'
pip install -q -c constraints.txt 'e3nn==0.6.0'
python -c "import deepmd.pt_expt.train.training, deepmd.pt.model.model, torch; print('deepmd-kit', __import__('deepmd').__version__, 'on torch', torch.__version__)"
