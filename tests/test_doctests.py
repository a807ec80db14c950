"""Docstring examples are tests."""

import doctest
import importlib


def test_probe_docstring_examples():
    module = importlib.import_module("gradprobe.probe")  # the module, not the re-exported function
    result = doctest.testmod(module, raise_on_error=False)
    assert result.attempted > 0 and result.failed == 0
