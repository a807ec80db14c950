import functools

import pytest
import torch

import gradprobe
from gradprobe.zoo import reference_spec

pytest_plugins = ["pytester"]


@functools.cache
def _zoo_map(bug, variants, checks, diagnose):
    return gradprobe.probe(reference_spec(bug=bug), variants=variants, checks=checks, diagnose=diagnose)


@pytest.fixture(scope="session")
def zoo_map():
    """``zoo_map(bug, variants=None, checks=(), diagnose=True)``: a probed zoo spec, computed once per
    session (several test files assert different things about the same, costly, compiled probes)."""

    def get(bug=None, variants=None, checks=(), diagnose=True):
        return _zoo_map(bug, variants, tuple(checks), diagnose)

    return get


@pytest.fixture(autouse=True)
def _fixed_threads():
    # Two cores here: keep timings stable and avoid oversubscription.
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
