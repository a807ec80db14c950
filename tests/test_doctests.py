"""Docstring examples are tests."""

import doctest

import gradprobe.probe


def test_probe_docstring_examples():
    result = doctest.testmod(gradprobe.probe, raise_on_error=False)
    assert result.attempted > 0 and result.failed == 0
