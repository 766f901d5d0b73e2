"""`kvfleet bench router --override-cost`: what the router's cache-aware override itself costs a
request, stage by stage, with the hint lookup as it was (the chain's 125 keys as KEYS, named and
packed in Python) and as it is (the chain as one argument, the keys named by the script),
side by side in one run.

One process, one real redis-server on loopback holding the prompt's chain for one replica. Each
round runs, for one 2,000-token text prompt, what `Picker.matched_tokens` runs in the router: encode
(`prompt_token_ids`, the byte tokenizer), hash the chain (`block_hashes`), and the lookup, once
with each index (their order alternating round by round). Sequential, so the figures are the
override's own time (CPU + one loopback round trip), not queueing behind other requests, which
`kvfleet bench router` measures with the whole router under load.

On a shared machine a wall-clock p99 is mostly the run queue (the process waiting for a core), so
the report also gives the override's work without it: the router thread's CPU time per override
(encode + hash + the one-argument lookup, user + system, the socket calls included) and Redis' own
latency percentiles for the lookup's EVALSHA (`INFO latencystats`, measured inside the server).
Their sum bounds what the override costs a request on a machine with a core free for each.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvfleet_lab.fleet.bench import _pct
from kvfleet_lab.fleet.redis_servers import RedisNode
from kvfleet_lab.fleet.router_capacity import BENCH_KEY_FIELDS, TENANT, _prompt
from kvfleet_lab.processes import free_port

__all__ = ["OverrideCostReport", "bench_override_cost"]

_KEYS_RUNS_LUA = """
local bound = '(' .. ARGV[1]
local alive = nil
local runs = {}
for i, key in ipairs(KEYS) do
  local next_alive = {}
  local any = false
  for _, host in ipairs(redis.call('ZRANGEBYSCORE', key, bound, '+inf')) do
    if alive == nil or alive[host] then
      next_alive[host] = true
      runs[host] = i
      any = true
    end
  end
  if not any then break end
  alive = next_alive
end
local out = {}
for host, n in pairs(runs) do
  out[#out + 1] = host
  out[#out + 1] = n
end
return out
"""
"""The lookup script before: one KEYS entry per block."""


@dataclass(slots=True)
class Stage:
    p50_us: float
    p99_us: float
    mean_us: float


@dataclass(slots=True)
class OverrideCostReport:
    prompt_tokens: int
    blocks: int
    rounds: int
    stages: dict[str, Stage] = field(default_factory=dict)
    """encode, hash, lookup (keys), lookup (one argument), total (keys), total (one argument)."""
    redis_us_per_lookup: dict[str, float] = field(default_factory=dict)
    """Redis' own time per EVALSHA of each lookup (the rest of a lookup is the router's)."""
    ratio_total_p50: float = 0.0
    """total (one argument) / total (keys), medians."""
    ratio_total_p99: float = 0.0
    router_cpu_us: Stage | None = None
    """The router thread's CPU time per override (encode + hash + one-argument lookup)."""
    redis_lookup_us: dict[str, float] = field(default_factory=dict)
    """Redis' own latency of the one-argument lookup (p50, p99, p99.9: `INFO latencystats`)."""
    work_p99_us: float = 0.0
    """router_cpu_us p99 + Redis' own lookup p99: the override's work at p99, run queue aside."""
    load_average: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def _stage(samples: Sequence[float]) -> Stage:
    return Stage(round(_pct(samples, 0.5) * 1e6, 1), round(_pct(samples, 0.99) * 1e6, 1),
                 round(statistics.fmean(samples) * 1e6, 1))


def bench_override_cost(*, prompt_tokens: int = 2000, rounds: int = 2000) -> OverrideCostReport:
    from kvfleet_runtime.cache import CacheKey, block_hashes
    from kvfleet_runtime.fleet.hint_index import RedisHintIndex
    from kvfleet_runtime.picker import prompt_token_ids

    prompt = _prompt(prompt_tokens)
    key = CacheKey(TENANT, *BENCH_KEY_FIELDS)
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisNode(free_port(), Path(tmp) / "redis")
        redis.start()
        try:
            return asyncio.run(_rounds(redis.url, prompt, key, rounds, prompt_token_ids,
                                       block_hashes, RedisHintIndex))
        finally:
            redis.kill()


async def _rounds(url: str, prompt: str, key: Any, rounds: int, encode: Any, hash_chain: Any,
                  index_class: Any) -> OverrideCostReport:
    after = index_class.from_url(url, lookup_budget_s=1.0, write_timeout_s=5.0)
    before = index_class.from_url(url, lookup_budget_s=1.0, write_timeout_s=5.0)
    keys_script = before._client.register_script(_KEYS_RUNS_LUA)
    ids = encode(prompt, "byte-v1", None)
    hashes = hash_chain(key, ids)
    await after.publish("r3", hashes, tenant=TENANT)

    async def lookup_keys(chain: Sequence[bytes]) -> dict[str, int]:
        # The lookup as it was: every block's key named here and sent as KEYS.
        names = [before._block_key(h, TENANT) for h in chain]
        flat = await keys_script(keys=names, args=[repr(time.time())])
        return {(m.decode() if isinstance(m, bytes) else m): int(n)
                for m, n in zip(flat[::2], flat[1::2], strict=True)}

    async def lookup_arg(chain: Sequence[bytes]) -> dict[str, int]:
        runs: dict[str, int] = await after.lookup_runs(chain, tenant=TENANT)
        return runs

    want = {"r3": len(hashes)}
    for name, lookup in (("keys", lookup_keys), ("one argument", lookup_arg)):
        if (runs := await lookup(hashes)) != want:
            raise RuntimeError(f"lookup ({name}) answered {runs}, not {want}")
    samples: dict[str, list[float]] = {name: [] for name in (
        "encode", "hash", "lookup (keys)", "lookup (one argument)")}
    router_cpu: list[float] = []
    for i in range(rounds):
        cpu0 = time.thread_time()
        t0 = time.perf_counter()
        token_ids = encode(prompt, "byte-v1", None)
        t1 = time.perf_counter()
        chain = hash_chain(key, token_ids)
        t2 = time.perf_counter()
        samples["encode"].append(t1 - t0)
        samples["hash"].append(t2 - t1)
        order = [("lookup (keys)", lookup_keys), ("lookup (one argument)", lookup_arg)]
        cpu_hashed = time.thread_time()
        for name, lookup in order if i % 2 == 0 else order[::-1]:
            t, cpu = time.perf_counter(), time.thread_time()
            runs = await lookup(chain)
            samples[name].append(time.perf_counter() - t)
            if name == "lookup (one argument)":
                router_cpu.append(cpu_hashed - cpu0 + time.thread_time() - cpu)
            if runs != want:
                raise RuntimeError(f"{name}: {runs} != {want} after {time.perf_counter() - t:.3f} s"
                                   f" ({after.stats}, {before.stats})")
    # Redis' own time per call of each script (INFO commandstats, counted one kind at a time).
    server_us: dict[str, float] = {}
    for name, lookup in (("lookup (keys)", lookup_keys), ("lookup (one argument)", lookup_arg)):
        await after._client.config_resetstat()
        for _ in range(200):
            await lookup(hashes)
        stats = await after._client.info("commandstats")
        server_us[name] = round(float(stats["cmdstat_evalsha"]["usec_per_call"]), 1)
    # Redis' own latency of the one-argument lookup over as many calls as the rounds made.
    await after._client.config_resetstat()
    for _ in range(rounds):
        await lookup_arg(hashes)
    latency = (await after._client.info("latencystats")).get("latency_percentiles_usec_evalsha")
    await after.close()
    await before.close()
    base = [e + h for e, h in zip(samples["encode"], samples["hash"], strict=True)]
    samples["total (keys)"] = [b + x for b, x in zip(base, samples["lookup (keys)"], strict=True)]
    samples["total (one argument)"] = [
        b + x for b, x in zip(base, samples["lookup (one argument)"], strict=True)]
    report = OverrideCostReport(len(prompt), len(hashes), rounds,
                                {name: _stage(v) for name, v in samples.items()}, server_us)
    report.router_cpu_us = _stage(router_cpu)
    if isinstance(latency, dict):  # absent before Redis 7
        report.redis_lookup_us = {k: float(v) for k, v in latency.items()}
        report.work_p99_us = round(report.router_cpu_us.p99_us + report.redis_lookup_us["p99"], 1)
    old, new = report.stages["total (keys)"], report.stages["total (one argument)"]
    report.ratio_total_p50 = round(new.p50_us / old.p50_us, 3)
    report.ratio_total_p99 = round(new.p99_us / old.p99_us, 3)
    report.load_average = os.getloadavg()
    return report
