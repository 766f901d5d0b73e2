"""The rollout's `/cache/stats` fallback backs off pods that never answer, as the load-report
reader does: one that did not answer within the budget is not asked again until its back-off
ends, so the next evaluations cost nothing on its account; the back-off is per object (one
rollout's read does not clear another's) and `forget` drops an object's entries. Two real HTTP
servers on loopback (127.0.0.1 and 127.0.0.2, one port: a Deployment's pods share their port);
the clock is injected, nothing sleeps."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvfleet_operator.api import CacheStatsSource, MetricsSpec
from kvfleet_operator.main import Tracked
from kvfleet_operator.metrics import CacheStatsReader, DeploymentPods, read_hit_rates

GOOD, SILENT = "127.0.0.1", "127.0.0.2"


class Pod:
    def __init__(self, ip: str, port: int, silent: bool) -> None:
        self.silent = silent
        self.num_asked = 0
        self.release = threading.Event()
        pod = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                pod.num_asked += 1
                if pod.silent:
                    pod.release.wait(30)
                    return
                body = {"totals": {"num_matched_tokens": 30, "num_lookup_tokens": 100}}
                self.send_response(200)
                self.end_headers()
                self.wfile.write(json.dumps(body).encode())

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer((ip, port), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()


@pytest.fixture
def pods() -> Iterator[tuple[Pod, Pod, CacheStatsSource]]:
    good = Pod(GOOD, 0, silent=False)
    silent = Pod(SILENT, good.port, silent=True)
    yield good, silent, CacheStatsSource(port=good.port, timeout_seconds=0.5)
    good.close()
    silent.close()


def wait_asked(pod: Pod, n: int) -> None:
    deadline = time.monotonic() + 30  # the request is on its way; wait for it to arrive
    while pod.num_asked < n:
        assert time.monotonic() < deadline, f"asked {pod.num_asked} times, expected {n}"
        time.sleep(0.01)


def test_a_pod_that_never_answers_is_skipped_for_a_doubling_back_off(
    pods: tuple[Pod, Pod, CacheStatsSource],
) -> None:
    good, silent, source = pods
    now = [100.0]
    reader = CacheStatsReader(base_backoff_s=10, max_backoff_s=15, clock=lambda: now[0])
    ips = [GOOD, SILENT]
    owner = ("rollout", "ns", "roll")
    assert reader(source, ips, owner=owner) == 0.3  # one budget spent on the silent pod
    wait_asked(silent, 1)
    for _ in range(3):  # the next evaluations within the back-off do not ask it at all
        assert reader(source, ips, owner=owner) == 0.3
    assert good.num_asked == 4 and silent.num_asked == 1

    now[0] += 10  # the back-off is over: asked again, silent again, 20 s capped at 15
    assert reader(source, ips, owner=owner) == 0.3
    wait_asked(silent, 2)
    now[0] += 14.9
    reader(source, ips, owner=owner)
    assert silent.num_asked == 2
    now[0] += 0.1
    silent.silent = False  # it answers: cleared, and counted
    assert reader(source, ips, owner=owner) == 0.3
    assert silent.num_asked == 3
    assert reader.backoff.skipped([f"http://{SILENT}:{source.port}{source.path}"], owner) == []
    assert len(reader.backoff) == 0


def test_the_back_off_is_per_object_and_forgotten_with_it(
    pods: tuple[Pod, Pod, CacheStatsSource],
) -> None:
    _good, silent, source = pods
    tracked = Tracked(cache_stats=CacheStatsReader(clock=lambda: 0.0))
    a, b = ("rollout", "ns", "a"), ("rollout", "ns", "b")
    tracked.cache_stats(source, [SILENT], owner=a)
    tracked.cache_stats(source, [GOOD], owner=b)  # b's fleet is another: a's entry stays
    wait_asked(silent, 1)
    tracked.cache_stats(source, [SILENT], owner=a)
    assert silent.num_asked == 1
    assert tracked.sizes()["stats_backoff"] == 1
    tracked.forget(a)  # a was deleted (a new rollout of that name asks its pods again)
    assert tracked.sizes() == {"schedule": 0, "locks": 0, "nvme_backoff": 0, "stats_backoff": 0,
                               "home_set_plans": 0}
    tracked.cache_stats(source, [SILENT], owner=a)
    wait_asked(silent, 2)


def test_read_hit_rates_reads_the_fallback_through_the_reader(
    pods: tuple[Pod, Pod, CacheStatsSource],
) -> None:
    good, silent, source = pods
    reader = CacheStatsReader(clock=lambda: 0.0)
    spec = MetricsSpec.model_validate({"cacheStats": source.model_dump(by_alias=True)})
    target = DeploymentPods("ns", "llm", (GOOD, SILENT))
    for _ in range(3):
        assert read_hit_rates(spec, target, None, read_stats=reader).target_hit_rate == 0.3
    wait_asked(silent, 1)
    assert good.num_asked == 3 and silent.num_asked == 1
