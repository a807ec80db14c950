import pytest
import torch

from gradprobe.zoo import reference_spec
from gradprobe.zoo.reference import REFERENCE_NOTES


@pytest.fixture
def ref_spec():
    """The reference potential's spec: CPU, float64, terms mode."""
    return reference_spec()


@pytest.fixture
def ref_notes():
    return REFERENCE_NOTES


@pytest.fixture(autouse=True)
def _fixed_threads():
    # Two cores here: keep timings stable and avoid oversubscription.
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
