"""Load a script of ``examples/`` as a real module, for tests that use its classes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(filename: str) -> ModuleType:
    """``examples/<filename>`` imported under its own name and kept in ``sys.modules``: dynamo looks
    classes up by their module, which ``runpy.run_path``'s ``'<run_path>'`` is not."""
    name = f"gradprobe_example_{Path(filename).stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / filename)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
