"""The soak's shortened form (issue 44 item 3): `kvfleet bench soak` for 90 s on real processes
(a router, three tiny-checkpoint replicas, redis-server with the ACL users), every fault of the
schedule injected once. Every request must end `ok` or with a failure the docs promise, and every
process that lived through the run must end within the RSS and fd bounds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvfleet_lab.fleet.redis_servers import redis_tools_missing
from kvfleet_lab.fleet.soak import FAULTS, SoakOptions, classify, render, run_soak

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("status", "cause", "verdict"), [
    (200, "ok", "ok"),
    (503, "no_replica", "promised"),
    (200, "upstream_failed", "promised"),
    (408, "body_timeout", "promised"),
    (500, "internal_error", "unexplained"),
    (0, "ClientConnectorError", "unexplained"),
    (200, "no [DONE]", "unexplained"),
    (408, "no code", "unexplained"),
])
def test_only_the_documented_failures_are_explained(status: int, cause: str, verdict: str
                                                    ) -> None:
    assert classify(status, cause) == verdict


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("soak-model") / "tiny"
    subprocess.run([sys.executable, "-m", "kvfleet_runtime.cli", "model", "generate", "--out",
                    str(out), "--preset", "tiny"], check=True, capture_output=True, timeout=300)
    return out


def test_a_short_soak_loses_no_request_and_stays_flat(tmp_path: Path, tiny_model: Path) -> None:
    missing = redis_tools_missing()
    if missing:
        pytest.skip(missing)
    report = run_soak(SoakOptions(work_dir=tmp_path, duration_s=90.0, bucket_s=5.0,
                                  outage_s=3.0, model_dir=tiny_model))
    text = render(report)
    assert report.num_unexplained == 0, text
    assert report.num_ok > 100, text
    assert set(report.failures) <= {
        "promised 408 body_timeout (slow_client)", "promised 200 upstream_failed (load)",
        "promised 503 no_replica (load)"}, text
    faults = {f.name: f for f in report.faults}
    assert list(faults) == list(FAULTS), text
    assert not any("error" in f.notes for f in report.faults), text
    rewrite = faults["config_rewrite"].notes
    assert rewrite["1_invalid"]["status"] == 200 and rewrite["1_invalid"]["config_errors"], text
    assert not rewrite["2_valid"]["config_errors"], text
    assert (rewrite["2_valid"]["config_applied_at_poll"]
            > rewrite["1_invalid"]["config_applied_at_poll"]), text
    assert faults["peer_cut"].notes["connections_cut"] >= 1, text
    assert faults["slow_client"].notes["slow_body"].startswith("408 body_timeout"), text
    assert faults["slow_client"].notes["slow_reader"].startswith("200 ok"), text
    assert report.processes_start and report.processes_end, text
    assert report.growth_violations == [], text
