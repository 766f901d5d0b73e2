"""Suite-wide hooks. A run in which no test passed is a failed run, not a green one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Processes the tests start (`python -m kvfleet_runtime.cli ...`, replicas, routers) import this
# checkout too, like the test process itself (pyproject's `pythonpath`).
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT / "runtime"), str(ROOT / "operator"), str(ROOT)]
    + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
)

# The k8s_cluster / k8s_namespace fixtures (a real control plane on loopback): tests/cluster.
pytest_plugins = ["tests.cluster.fixtures"]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or exitstatus != 0:
        return
    passed = len(reporter.stats.get("passed", []))
    if passed == 0 and not session.config.option.collectonly:
        reporter.write_line("no test passed: failing the run", red=True)
        session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED
