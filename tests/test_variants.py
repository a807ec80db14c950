"""Variant spellings and knobs."""

import re

import pytest

from gradprobe import SpecError
from gradprobe.variants import parse_variant, parse_variants


@pytest.mark.parametrize(
    ("text", "name", "capture", "backend", "knobs"),
    [
        ("eager", "eager", "eager", None, {}),
        ("make_fx", "make_fx", "make_fx", None, {}),
        ("compile:aot_eager", "compile:aot_eager", "eager", "aot_eager", {}),
        ("make_fx+compile:inductor", "make_fx+compile:inductor", "make_fx", "inductor", {}),
        (
            "make_fx[mode=eval, detach=alias]+compile:aot_eager[dynamic=true]",
            "make_fx[mode=eval,detach=alias]+compile:aot_eager[dynamic=true]",
            "make_fx", "aot_eager", {"mode": "eval", "detach": "alias", "dynamic": True},
        ),
        ("compile:eager[fullgraph=true,mode=train]", "compile:eager[fullgraph=true,mode=train]", "eager", "eager",
         {"fullgraph": True, "mode": "train"}),
        ("make_fx[detach=keep]", "make_fx", "make_fx", None, {}),  # defaults are not spelled
        ("eager[autocast=bf16]", "eager[autocast=bf16]", "eager", None, {"autocast": "bf16"}),
    ],
)  # fmt: skip
def test_spellings(text, name, capture, backend, knobs):
    v = parse_variant(text)
    assert (v.name, v.capture, v.backend, v.knobs) == (name, capture, backend, knobs)
    assert parse_variant(v.name) == v  # the canonical name reads back to the same variant


def test_list_splits_outside_brackets():
    names = [v.name for v in parse_variants("eager,make_fx[detach=alias,mode=eval]+compile:eager")]
    assert names == ["eager", "make_fx[mode=eval,detach=alias]+compile:eager"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("compile:inductr", "unknown backend 'inductr' (did you mean 'inductor'?)"),
        ("make_fx[detach=drop]", "knob detach=drop for make_fx: allowed values are keep|alias"),
        ("make_fx[detatch=alias]", "unknown knob 'detatch' for make_fx (did you mean 'detach'?)"),
        ("compile:eager+make_fx", "unknown variant"),
        ("jit", "unknown variant 'jit'"),
        ("eager,eager", "listed twice"),
    ],
)
def test_bad_spellings(text, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        parse_variants(text)
