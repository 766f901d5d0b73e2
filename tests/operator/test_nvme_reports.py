"""Reading the replicas' T3 load reports for the policy's NVMe decision: a replica that does not
answer costs one budget, then is skipped for a back-off that doubles while it stays silent, and
is asked again as soon as the back-off ends (it answers: cleared). Real HTTP servers on loopback;
the clock is injected, nothing sleeps."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvfleet_operator.metrics import NvmeReportReader, read_nvme_reports

SECTION = {"1": {"num_reads": 3, "num_bytes": 3 << 20, "seconds": 0.01, "aggregate_gb_s": 0.3}}


class Replica:
    """A loopback stand-in for one replica's `GET /fleet/v1/load`; `silent`: it accepts the
    request and never answers (what an IP without a live endpoint looks like to the reader)."""

    def __init__(self, silent: bool) -> None:
        self.silent = silent
        self.num_asked = 0
        self.release = threading.Event()
        replica = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                replica.num_asked += 1
                if replica.silent:
                    replica.release.wait(30)
                    return
                body = json.dumps({"nvme": {"mode": "shadow", "read_bandwidth": SECTION}})
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/fleet/v1/load"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()


@pytest.fixture
def replicas() -> Iterator[tuple[Replica, Replica]]:
    good, silent = Replica(silent=False), Replica(silent=True)
    yield good, silent
    good.close()
    silent.close()


def wait_asked(replica: Replica, n: int) -> None:
    deadline = time.monotonic() + 30  # the request is on its way; wait for it to arrive
    while replica.num_asked < n:
        assert time.monotonic() < deadline, f"asked {replica.num_asked} times, expected {n}"
        time.sleep(0.01)


def test_a_silent_replica_is_skipped_for_a_doubling_back_off(
    replicas: tuple[Replica, Replica],
) -> None:
    good, silent = replicas
    now = [100.0]
    reader = NvmeReportReader(timeout_s=0.5, base_backoff_s=10, max_backoff_s=15,
                              clock=lambda: now[0])
    urls = [good.url, silent.url]
    assert reader(urls) == [SECTION]  # one budget spent on the silent one
    wait_asked(silent, 1)
    assert reader.skipped(urls) == [silent.url]
    for _ in range(3):  # later reconciles within the back-off do not ask it at all
        assert reader(urls) == [SECTION]
    assert good.num_asked == 4 and silent.num_asked == 1

    now[0] += 10  # the back-off is over: asked again, silent again, 20 s capped at 15
    assert reader.skipped(urls) == []
    assert reader(urls) == [SECTION]
    wait_asked(silent, 2)
    now[0] += 14.9
    assert reader.skipped(urls) == [silent.url]
    now[0] += 0.1
    assert reader.skipped(urls) == []

    silent.silent = False  # it answers: cleared, and counted in the measurement
    assert reader(urls) == [SECTION, SECTION]
    assert reader.skipped(urls) == []
    assert silent.num_asked == 3


def test_a_replica_that_left_the_fleet_is_forgotten(replicas: tuple[Replica, Replica]) -> None:
    good, silent = replicas
    reader = NvmeReportReader(timeout_s=0.5, clock=lambda: 0.0)
    reader([good.url, silent.url])
    assert reader.skipped([silent.url]) == [silent.url]
    reader([good.url])  # its pod went away
    assert reader.skipped([silent.url]) == []  # a new pod at that address is asked


def test_the_plain_read_skips_silent_replicas_within_one_budget(
    replicas: tuple[Replica, Replica],
) -> None:
    good, silent = replicas
    assert read_nvme_reports([good.url, silent.url, good.url], timeout_s=0.5) == [SECTION] * 2


def test_bad_back_off_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="got 10, 5"):
        NvmeReportReader(base_backoff_s=10, max_backoff_s=5)
