"""Where a failure is: the user's frame, never the import machinery (``<frozen importlib._bootstrap>``)."""

from __future__ import annotations

import importlib
import traceback

from gradprobe.frames import (
    is_import_machinery,
    is_user_file,
    user_frame_in_stack_trace,
    user_frame_in_text,
    user_frame_of,
)


def _import_missing() -> None:
    importlib.import_module("gradprobe_user_no_such_module")  # the user's line


def test_import_machinery_is_never_the_users_frame():
    try:
        _import_missing()
    except ModuleNotFoundError as e:
        where = user_frame_of(e)
        printed = "".join(traceback.format_exception(e))
    assert where is not None and where["file"] == __file__ and where["function"] == "_import_missing"
    assert "import_module" in where["code"]
    assert "<frozen importlib._bootstrap>" in printed  # the traceback does go through it
    named = user_frame_in_text(printed)
    assert named is not None and named["file"] == __file__ and named["function"] == "_import_missing"


def test_frozen_frames_in_text_and_stack_traces():
    text = (
        'Traceback (most recent call last):\n  File "/home/u/mymodel.py", line 7, in step\n    import helper\n'
        '  File "<frozen importlib._bootstrap>", line 1140, in _find_and_load\n'
        '  File "<frozen importlib._bootstrap_external>", line 940, in exec_module\n'
        "ModuleNotFoundError: No module named 'helper'\n"
    )
    assert user_frame_in_text(text) == {
        "file": "/home/u/mymodel.py", "line": 7, "function": "step", "code": "import helper",
    }  # fmt: skip
    assert user_frame_in_stack_trace(text)["file"] == "/home/u/mymodel.py"
    for path in (
        "<frozen importlib._bootstrap>",
        "<frozen runpy>",
        "/usr/lib/python3.11/importlib/__init__.py",
    ):
        assert is_import_machinery(path) and not is_user_file(path)
    assert not is_import_machinery("/home/u/mymodel.py") and is_user_file("/home/u/mymodel.py")
