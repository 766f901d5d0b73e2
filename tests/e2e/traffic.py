"""Traffic from the vendored Mooncake trace, scaled to the tiny model, sent through the router.

The trace (kvfleet_lab.traces.DEFAULT_TRACE, vendored in the repository) has no tenants and
40k-token prompts. We keep the requests of its NUM_TENANTS most shared roots (a root hash id is a
family of requests with a common prefix: one tenant's system prompt and documents), in trace order,
and scale each hash id (512 tokens in Mooncake) to one 16-token block of byte tokens derived from
the id, at most MAX_BLOCKS of them per prompt. Equal hash-id prefixes stay equal token prefixes, so
the trace's sharing structure survives. The subset is replayed in a loop, at a bounded rate, by a
few client threads with the tenants' API keys.
"""

from __future__ import annotations

import collections
import json
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvfleet_lab.traces import DEFAULT_TRACE
from tests.e2e.kubelet import http_json_headers

TRACE = DEFAULT_TRACE
NUM_TENANTS = 48
MAX_BLOCKS = 8
BLOCK_TOKENS = 16
MAX_REQUESTS = 400


@dataclass(frozen=True, slots=True)
class TraceRequest:
    tenant: str
    token_ids: tuple[int, ...]


def tenant_name(rank: int) -> str:
    return f"t{rank:02d}"


def api_key(tenant: str) -> str:
    return f"sk-e2e-{tenant}"


def _block(hash_id: int) -> list[int]:
    rng = random.Random(hash_id)
    return [rng.randrange(256) for _ in range(BLOCK_TOKENS)]


def load_requests(path: Path = TRACE) -> list[TraceRequest]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    roots = collections.Counter(row["hash_ids"][0] for row in rows)
    ranked = [root for root, _ in roots.most_common(NUM_TENANTS)]
    tenant_of = {root: tenant_name(i) for i, root in enumerate(ranked)}
    out = []
    for row in rows:
        tenant = tenant_of.get(row["hash_ids"][0])
        if tenant is None:
            continue
        tokens = [t for h in row["hash_ids"][:MAX_BLOCKS] for t in _block(h)]
        out.append(TraceRequest(tenant, tuple(tokens)))
        if len(out) == MAX_REQUESTS:
            break
    return out


@dataclass
class Sample:
    at: float
    tenant: str
    status: int
    prompt_tokens: int
    cached_tokens: int
    detail: str = ""  # a failure's message and the replica that gave it (the router's headers)


@dataclass
class Traffic:
    """Replays `requests` through the router at `router_url` until stopped."""

    router_url: str
    requests: list[TraceRequest]
    model: str
    num_clients: int = 2
    max_rps: float = 12.0
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _next: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, request: TraceRequest) -> Sample:
        status, headers, body = http_json_headers(
            f"{self.router_url}/v1/completions",
            {"model": self.model, "prompt": list(request.token_ids), "max_tokens": 1,
             "temperature": 0},
            headers={"Authorization": f"Bearer {api_key(request.tenant)}"},
            timeout_s=30,
        )
        cached, detail = 0, ""
        if status == 200:
            cached = int(body["usage"]["prompt_tokens_details"]["cached_tokens"])
        else:
            error = body.get("error", {}) if isinstance(body, dict) else {}
            message = error.get("message", body) if isinstance(error, dict) else error
            detail = (f"replica {headers.get('X-Kvfleet-Replica', '?')} "
                      f"(route {headers.get('X-Kvfleet-Route', '?')}): {str(message)[:200]}")
        return Sample(time.monotonic(), request.tenant, status, len(request.token_ids), cached,
                      detail)

    def _client(self) -> None:
        period_s = self.num_clients / self.max_rps
        while not self._stop.is_set():
            started = time.monotonic()
            with self._lock:
                request = self.requests[self._next % len(self.requests)]
                self._next += 1
            sample = self.send(request)
            with self._lock:
                self.samples.append(sample)
            self._stop.wait(max(0.0, period_s - (time.monotonic() - started)))

    def start(self) -> None:
        for i in range(self.num_clients):
            thread = threading.Thread(target=self._client, name=f"traffic-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(40)

    def recent(self, seconds: float) -> list[Sample]:
        cutoff = time.monotonic() - seconds
        with self._lock:
            return [s for s in self.samples if s.at >= cutoff]

    def summary(self, seconds: float) -> str:
        recent = self.recent(seconds)
        ok = [s for s in recent if s.status == 200]
        statuses = collections.Counter(s.status for s in recent)
        hit = sum(s.cached_tokens for s in ok) / max(1, sum(s.prompt_tokens for s in ok))
        failures = [f"{s.status} at {s.at:.1f} ({s.tenant}): {s.detail}"
                    for s in recent if s.status != 200][:5]
        return (f"last {seconds:.0f}s: {len(recent)} requests, statuses {dict(statuses)}, "
                f"token hit rate {hit:.2f}" + "".join(f"\n  {f}" for f in failures))

    def hit_rate(self, seconds: float) -> float:
        ok = [s for s in self.recent(seconds) if s.status == 200]
        return sum(s.cached_tokens for s in ok) / max(1, sum(s.prompt_tokens for s in ok))

