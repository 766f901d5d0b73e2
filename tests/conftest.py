"""Suite-wide hooks. A run in which no test passed is a failed run, not a green one."""

from __future__ import annotations

import pytest

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
