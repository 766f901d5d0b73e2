"""The vLLM connector's T2 fetch, timed against the transfer it is made of.

A kvfleet peer process (`kvfleet_lab.fleet.bench.serve_t2`: a `PrefixCache` holding the prompt's
KV, served over kvfleet's T2 routes on loopback) and this process, alternating per repetition:

- connector: what `get_num_new_matched_tokens` sets off (`PeerService.poll`): the hint lookup
  (the embedded index), slots reserved pending in the host pool, the transfer received straight
  into those slots with every check (`PeerFetcher.fetch_into`), the blocks made visible; timed
  from `poll` until the host pool answers them (`ConnectorIndex.num_matched`);
- transfer: `PeerFetcher.fetch_from` alone, the same run into recycled receive buffers.

Each connector repetition gets a fresh index and T2 thread (started outside the timer) over one
host pool mapped once (as the engine-core process maps it), so every fetch is a miss and the
pool's pages are already mapped (a fresh mapping per fetch costs ~3x the copy in page faults).
Runs in the main environment or vLLM's (no vllm import):

    PYTHONPATH=runtime:operator:. python -m kvfleet_lab.vllm.t2 [--tokens 2000] [--reps 7]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvfleet_lab.fleet.bench import BENCH_KEY, BENCH_SECRET, _process, _tokens
from kvfleet_lab.processes import free_port
from kvfleet_runtime.cache import BLOCK_SIZE, KVLayout

if TYPE_CHECKING:
    from kvfleet_vllm._copy import HostPool

__all__ = ["T2FetchResult", "bench_connector_fetch", "main"]


@dataclass(slots=True)
class T2FetchResult:
    num_tokens: int
    num_bytes: int
    connector_s: list[float] = field(default_factory=list)
    transfer_s: list[float] = field(default_factory=list)

    @property
    def connector_median_s(self) -> float:
        return statistics.median(self.connector_s)

    @property
    def transfer_median_s(self) -> float:
        return statistics.median(self.transfer_s)

    @property
    def ratio(self) -> float:
        """Connector time over the bare transfer's (1.0: the connector adds nothing)."""
        return self.connector_median_s / self.transfer_median_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"connector_median_s": self.connector_median_s,
                               "transfer_median_s": self.transfer_median_s, "ratio": self.ratio}


def bench_connector_fetch(*, num_tokens: int = 2000, reps: int = 7, num_layers: int = 8,
                          num_kv_heads: int = 8, head_dim: int = 128) -> T2FetchResult:
    num_blocks = num_tokens // BLOCK_SIZE
    if num_blocks < 2 or reps < 1:
        raise ValueError(f"need num_tokens >= {2 * BLOCK_SIZE} and reps >= 1")
    layout = KVLayout(num_layers, num_kv_heads, head_dim, dtype="float16")
    port = free_port()
    code = ("from kvfleet_lab.fleet.bench import serve_t2; "
            f"serve_t2({port}, {num_layers}, {num_kv_heads}, {head_dim}, {num_tokens})")
    result = T2FetchResult(num_tokens, num_blocks * layout.bytes_per_block)
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d, \
            _process(code):
        from kvfleet_vllm._copy import HostPool

        pool = HostPool(Path(d) / "pool", layout, num_blocks + 8)
        url = f"http://127.0.0.1:{port}"
        for i in range(reps + 1):  # the first pair warms connections, servers and pages
            if i % 2:
                c, t = _connector_once(pool, url, num_blocks), _transfer_once(url, num_blocks)
            else:
                t, c = _transfer_once(url, num_blocks), _connector_once(pool, url, num_blocks)
            if i:
                result.connector_s.append(c)
                result.transfer_s.append(t)
    return result


def _connector_once(pool: HostPool, url: str, num_blocks: int) -> float:
    from kvfleet_runtime.cache import block_hashes
    from kvfleet_runtime.fleet import EmbeddedHintIndex, FleetSettings
    from kvfleet_vllm._connector_index import ConnectorIndex
    from kvfleet_vllm._peer import PeerService

    # One block more than the run: the prompt's last token is computed, never fetched.
    tokens = _tokens(num_blocks * BLOCK_SIZE + 1)
    index = ConnectorIndex(pool.layout, pool.num_slots, vllm_block_size=BLOCK_SIZE,
                           clock=time.monotonic)
    hints = EmbeddedHintIndex()
    settings = FleetSettings(name="bench-vllm", peer_url="http://127.0.0.1:0",
                             secret=BENCH_SECRET, min_fetch_blocks=1)
    service = PeerService(index, pool, settings, port=0,
                          bind_host="127.0.0.1", hints=hints, wait_s=30.0)
    service.start()
    try:
        chain = block_hashes(BENCH_KEY, tokens)
        service.call(hints.publish("bench-peer", chain))
        service.call(hints.register_host("bench-peer", url))
        start = time.perf_counter()
        while service.poll("r", BENCH_KEY, tokens, 0):
            time.sleep(0.002)
        elapsed = time.perf_counter() - start
        matched = index.num_matched(BENCH_KEY, tokens, 0)
        if matched != num_blocks * BLOCK_SIZE or service.stats.outcomes != {"ok": 1}:
            raise RuntimeError(f"connector fetched {matched} tokens ({service.stats.outcomes})")
        return elapsed
    finally:
        service.close()


def _transfer_once(url: str, num_blocks: int) -> float:
    from kvfleet_runtime.fleet import EmbeddedHintIndex, PeerFetcher

    tokens = _tokens(num_blocks * BLOCK_SIZE)

    async def run() -> float:
        fetcher = PeerFetcher(BENCH_SECRET, EmbeddedHintIndex(), "bench-client")
        start = time.perf_counter()
        got = await fetcher.fetch_from(url, BENCH_KEY, tokens, 0, num_blocks)
        elapsed = time.perf_counter() - start
        if got.num_blocks != num_blocks or got.partial:
            raise RuntimeError(f"T2 fetched {got.num_blocks} of {num_blocks} blocks")
        return elapsed

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvfleet_lab.vllm.t2", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        r = bench_connector_fetch(num_tokens=args.tokens, reps=args.reps)
    except ValueError as exc:
        parser.error(str(exc))
    if args.json:
        print(json.dumps(r.to_dict(), indent=2))  # noqa: T201 - the command's output
        return
    mib = r.num_bytes / (1 << 20)
    print(f"T2 fetch of {r.num_tokens:,} tokens ({mib:.1f} MiB), median of {len(r.transfer_s)}")  # noqa: T201
    for name, s in (("transfer", r.transfer_median_s), ("connector", r.connector_median_s)):
        print(f"  {name:<10} {s * 1e3:8.2f} ms  {r.num_bytes / s / 1e9:6.2f} GB/s")  # noqa: T201
    print(f"  connector / transfer: {r.ratio:.2f}x")  # noqa: T201


if __name__ == "__main__":
    main()
