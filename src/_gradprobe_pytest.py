"""gradprobe's pytest plugin. Imports neither torch nor gradprobe at load time: loading it costs nothing
in suites that do not use it. Off until used: the ``gradprobe_snapshot`` fixture and ``--gradprobe-update``."""

from __future__ import annotations

import re
import sys
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gradprobe")
    group.addoption(
        "--gradprobe-update",
        action="store_true",
        help="rewrite gradprobe flow-map snapshots instead of comparing with them (after an intended change)",
    )


@pytest.fixture
def gradprobe_snapshot(request: pytest.FixtureRequest) -> Any:
    """``gradprobe_snapshot.match(flow_map)``: compare with ``__gradprobe__/<test>.flow.json`` beside the test."""
    from gradprobe.testing import Snapshot

    name = re.sub(r"[^\w.-]+", "_", request.node.name)
    path = request.path.parent / "__gradprobe__" / f"{name}.flow.json"
    return Snapshot(path, update=bool(request.config.getoption("--gradprobe-update")))


def pytest_assertrepr_compare(config: pytest.Config, op: str, left: Any, right: Any) -> list[str] | None:
    testing = sys.modules.get("gradprobe.testing")
    flowmap = sys.modules.get("gradprobe.flowmap")
    if op != "==" or flowmap is None or not isinstance(left, flowmap.FlowMap):
        return None
    if testing is None:
        import gradprobe.testing as testing
    return testing.assertrepr_compare(left, right)
