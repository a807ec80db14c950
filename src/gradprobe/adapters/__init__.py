"""Adapters for trainers people use, each an optional extra (see ``gradprobe.trainer`` for the protocol).

- ``gradprobe.adapters.deepmd``: DeePMD-kit 3.2 (``pt_expt`` backend), uncompiled vs ``enable_compile``.
- ``gradprobe.adapters.lightning``: a PyTorch Lightning callback that probes ``training_step``.
"""
