"""The discrete-event fleet simulation.

Events (a heapq ordered by time, then by insertion): a request arrives and is routed; a cache
fetch completes on a shared link; a prefill finishes (first token: TTFT is measured, the prefix is
offered to the cache); a replica's prefill server frees; the rollout controller ticks. Arrivals are
drawn up front from the seeded generator and merged with the heap, so a run is a pure function of
its config and seed: no wall clock is read (the cache managers read the simulated clock).

Each replica's cache is the shipped `CacheManager` (`_cache.ReplicaCache`: one manager block per
whole template prefix, and why). A request's tier is decided when it arrives, from what is cached
then; the manager sees the request as the replica's engine shows it: a hit when it is looked up,
a miss when its prefill has produced the KV (nothing is stored before it exists). A weights
version is part of the cache key, so a new version finds nothing of the old one.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

import numpy as np

from kvfleet_lab.simulate._cache import (
    TIER_DRAM,
    TIER_MISS,
    TIER_NVME,
    ReplicaCache,
    scaled_config,
    sketch_width,
)
from kvfleet_lab.simulate._config import Routing, SimConfig
from kvfleet_lab.simulate._link import SharedLink
from kvfleet_runtime.affinity import ReplicaLoad, choose_replica, home_sets
from kvfleet_runtime.cache import BLOCK_SIZE, BlockHash, CacheKey, block_hashes

__all__ = [
    "TIER_DRAM",
    "TIER_MISS",
    "TIER_NVME",
    "RolloutEvent",
    "SimResult",
    "replica_name",
    "simulate",
    "tenant_name",
    "version_digest",
]

_ARRIVAL_FETCH_DONE = 0
_PREFILL_DONE = 1
_SERVER_FREE = 2
_CONTROL = 3

_VERSION_SHIFT = 40
_BASELINE_WINDOW_S = 300.0
_NUM_VERSIONS = 2
_ROPE_CONFIG = "rope-default"
_ATTN_IMPL = "sim-sdpa"


def replica_name(index: int) -> str:
    return f"replica-{index:03d}"


def tenant_name(index: int) -> str:
    return f"tenant-{index:05d}"


def version_digest(version: int) -> str:
    """The weights digest of model version `version` (0: before the rollout, 1: after)."""
    return f"sha256:{version:064x}"


def prefix_tokens_of(prefix_id: int) -> list[int]:
    """The 16 token ids that stand for prefix `prefix_id` in its one-block chain: distinct
    prefixes, distinct tokens, so distinct hashes under the same key."""
    base = prefix_id * BLOCK_SIZE
    return [(base + t) % 2**32 for t in range(BLOCK_SIZE)]


@dataclass(slots=True)
class RolloutEvent:
    time_s: float
    kind: str
    """`step` (replicas switched), `gate` (the step's hit rate recovered), `rollback`."""
    num_new: int
    hit_rate: float | None = None


@dataclass(slots=True)
class SimResult:
    config: SimConfig
    arrival_s: np.ndarray
    tenant: np.ndarray
    prefix_id: np.ndarray
    """Template t of tenant n is n x templates_per_tenant + t; one-shot prefixes lie above."""
    ttft_s: np.ndarray
    tier: np.ndarray
    is_template: np.ndarray
    replica: np.ndarray
    spilled: np.ndarray
    new_version: np.ndarray
    fetch_s: np.ndarray
    resident_bytes: np.ndarray
    """DRAM bytes resident per replica at the end."""
    routed_template_bytes: np.ndarray
    """Bytes of the distinct templates each replica was asked for during the run."""
    rollout_events: list[RolloutEvent]
    surge_replica_s: float
    """Replica-seconds of surge capacity used (surge_factor - 1 per switching replica)."""
    baseline_hit_rate: float | None
    num_events: int


class _Replica:
    __slots__ = (
        "busy",
        "cache",
        "pending_tokens",
        "queue",
        "routed",
        "surge",
        "version",
    )

    def __init__(self, cache: ReplicaCache) -> None:
        self.cache = cache
        self.queue: deque[tuple[int, int]] = deque()
        self.busy = False
        self.pending_tokens = 0
        self.version = 0
        self.surge = 1.0
        self.routed: set[int] = set()


def simulate(config: SimConfig) -> SimResult:
    """Run one simulation to completion: arrivals stop at `duration_s`, in-flight requests drain."""
    wl, fleet, prof, routing = config.workload, config.fleet, config.profile, config.routing
    rng = np.random.default_rng(config.seed)
    n_rep = fleet.num_replicas
    prefix_bytes = wl.prefix_tokens * prof.kv_bytes_per_token
    dram_entries = fleet.cache_bytes // prefix_bytes
    nvme_entries = fleet.nvme_bytes // prefix_bytes
    rs = prof.recompute_s_per_token
    share = fleet.prefill_share
    held_bytes = (wl.prefix_tokens + wl.suffix_tokens) * prof.kv_bytes_per_token
    num_templates = wl.num_tenants * wl.templates_per_tenant

    # Arrivals, drawn up front.
    expected = wl.rps * config.duration_s
    n_draw = int(expected + 10 * np.sqrt(expected) + 100)
    arrival = np.cumsum(rng.exponential(1.0 / wl.rps, size=n_draw))
    arrival = arrival[arrival < config.duration_s]
    n = len(arrival)
    if wl.tenant_zipf_s > 0:
        weights = 1.0 / np.arange(1, wl.num_tenants + 1) ** wl.tenant_zipf_s
        tenants = rng.choice(wl.num_tenants, size=n, p=weights / weights.sum())
    else:
        tenants = rng.integers(0, wl.num_tenants, size=n)
    template_idx = rng.integers(0, wl.templates_per_tenant, size=n)
    is_template = rng.random(n) < wl.reuse_fraction
    prefix_id = np.where(
        is_template, tenants * wl.templates_per_tenant + template_idx, num_templates + np.arange(n)
    )
    random_replica = rng.integers(0, n_rep, size=n)
    tenants_l: list[int] = tenants.tolist()
    prefix_l: list[int] = prefix_id.tolist()
    arrival_l: list[float] = arrival.tolist()
    random_l: list[int] = random_replica.tolist()
    template_l: list[bool] = is_template.tolist()

    names = [replica_name(i) for i in range(n_rep)]
    index_of = {name: i for i, name in enumerate(names)}
    homes: list[tuple[int, ...]] = []
    if routing.policy is Routing.AFFINITY:
        sets = home_sets([tenant_name(t) for t in range(wl.num_tenants)], names, routing.k)
        homes = [tuple(index_of[r] for r in sets[tenant_name(t)]) for t in range(wl.num_tenants)]

    # Each replica's cache: the shipped manager, reading the simulated clock.
    clock_s = [0.0]
    versions = _NUM_VERSIONS if config.rollout is not None else 1
    width = sketch_width(num_templates * versions + n // n_rep + 1)
    dram_cfg = (
        scaled_config(
            dram_entries,
            wl.prefix_tokens,
            sketch_width=width,
            admit_min_sightings=fleet.admit_after,
        )
        if dram_entries
        else None
    )
    # NVMe takes what DRAM evicts: DRAM's admission already let it in.
    nvme_cfg = (
        scaled_config(nvme_entries, wl.prefix_tokens, sketch_width=width, admit_min_sightings=1)
        if nvme_entries
        else None
    )
    replicas = [
        _Replica(
            ReplicaCache(
                dram_cfg,
                nvme_cfg,
                prefix_bytes=prefix_bytes,
                prefix_tokens=wl.prefix_tokens,
                clock=lambda: clock_s[0],
            )
        )
        for _ in range(n_rep)
    ]
    keys = [
        [
            CacheKey(
                tenant_name(t),
                prof.model,
                version_digest(v),
                prof.kv_dtype,
                _ROPE_CONFIG,
                _ATTN_IMPL,
            )
            for t in range(wl.num_tenants)
        ]
        for v in range(versions)
    ]
    chains: dict[int, tuple[BlockHash, ...]] = {}

    def chain_of(version: int, tenant: int, pid: int) -> tuple[BlockHash, ...]:
        """The one-block chain of prefix `pid` under its tenant's key of `version`."""
        memo_key = (version << _VERSION_SHIFT) | pid
        chain = chains.get(memo_key)
        if chain is None:
            chain = tuple(block_hashes(keys[version][tenant], prefix_tokens_of(pid)))
            if pid < num_templates:  # one-shot prefixes are never asked for again
                chains[memo_key] = chain
        return chain

    dram_links = [SharedLink(prof.dram_bytes_per_s) for _ in range(n_rep)]
    nvme_links = [SharedLink(prof.nvme_bytes_per_s) for _ in range(n_rep)]

    if config.warm_start and dram_cfg is not None:
        # Affinity's steady state: every template seen often enough to be admitted at its first
        # home, as long as that home has room (nothing is evicted to warm it).
        warmed = [0] * n_rep
        for t in range(wl.num_tenants):
            h = homes[t][0]
            cache = replicas[h].cache
            for j in range(wl.templates_per_tenant):
                if warmed[h] >= dram_entries:
                    break
                chain = chain_of(0, t, t * wl.templates_per_tenant + j)
                for _ in range(dram_cfg.admit_min_sightings):
                    cache.offer(keys[0][t], chain)
                warmed[h] += cache.tier(chain) == TIER_DRAM

    ttft = np.full(n, np.nan)
    tier = np.zeros(n, dtype=np.int8)
    replica_of = np.zeros(n, dtype=np.int32)
    spilled = np.zeros(n, dtype=bool)
    new_version = np.zeros(n, dtype=bool)
    fetch_s = np.zeros(n)
    tier_l = [TIER_MISS] * n
    chain_l: list[tuple[BlockHash, ...]] = [()] * n  # each request's chain, from its arrival on
    rep_l = [0] * n

    heap: list[tuple[float, int, int, int, int]] = []
    seq = 0
    num_events = 0

    def push(time_s: float, kind: int, a: int, b: int = 0) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (time_s, seq, kind, a, b))

    # What the router sees of each replica, kept current so that least-loaded is one min():
    # the KV of the requests it sent there that have not finished (queued ones included, so a
    # burst cannot all land on one replica), and the prefill work queued there.
    inflight = [0] * n_rep  # occupancy = inflight x held_share, kept exact as a count
    queue_delay = [0.0] * n_rep
    releases: list[tuple[float, int]] = []  # (decode end, replica)
    held_share = held_bytes / fleet.hbm_kv_bytes

    def update_delay(r: int) -> None:
        rep = replicas[r]
        queue_delay[r] = rep.pending_tokens * rs / (share * rep.surge)

    def start_fetch(links: list[SharedLink], link_kind: int, r: int, i: int, now_s: float) -> None:
        link = links[r]
        link.start(now_s, i, prefix_bytes)
        done = link.next_done_s()
        assert done is not None
        push(done, _ARRIVAL_FETCH_DONE, r * 4 + link_kind, link.epoch)

    def enqueue(r: int, i: int, tokens: int, now_s: float) -> None:
        rep = replicas[r]
        rep.queue.append((i, tokens))
        rep.pending_tokens += tokens
        update_delay(r)
        if not rep.busy:
            start_prefill(r, now_s)

    def start_prefill(r: int, now_s: float) -> None:
        rep = replicas[r]
        i, tokens = rep.queue.popleft()
        rep.busy = True
        full_s = tokens * rs
        first_token_s = now_s + full_s
        heapq.heappush(releases, (first_token_s + wl.decode_s, r))
        push(first_token_s, _PREFILL_DONE, i, r)
        push(now_s + full_s / (share * rep.surge), _SERVER_FREE, r, tokens)

    # Rollout state.
    rollout = config.rollout
    events: list[RolloutEvent] = []
    completions: deque[tuple[float, int, bool]] = deque()  # (time, hit tokens, new version)
    step_index = -1
    step_start_s = 0.0
    num_new = 0
    baseline_hit: float | None = None
    halted = False
    surge_replica_s = 0.0
    surging: list[int] = []
    last_control_s = 0.0
    if rollout is not None:
        push(config.control_interval_s, _CONTROL, 0)

    def window_hit_rate(since_s: float, only_new: bool) -> float | None:
        hit = total = 0
        for t_done, hit_tokens, is_new in reversed(completions):
            if t_done < since_s:
                break
            if only_new and not is_new:
                continue
            hit += hit_tokens
            total += wl.prefix_tokens
        return hit / total if total else None

    def open_step(now_s: float) -> None:
        nonlocal step_index, step_start_s, num_new, surging
        assert rollout is not None
        step_index += 1
        target = max(1, int(np.ceil(rollout.steps[step_index] * n_rep - 1e-9)))
        surging = list(range(num_new, target))
        for r in surging:
            replicas[r].version = 1
            replicas[r].surge = rollout.surge_factor
            update_delay(r)
        num_new = target
        step_start_s = now_s
        events.append(RolloutEvent(now_s, "step", num_new))

    def close_surge() -> None:
        for r in surging:
            replicas[r].surge = 1.0
            update_delay(r)
        surging.clear()

    a = 0  # next arrival
    inf = float("inf")
    while True:
        next_arrival = arrival_l[a] if a < n else inf
        if heap and heap[0][0] <= next_arrival:
            now_s, _, kind, x, y = heapq.heappop(heap)
        elif a < n:
            now_s, kind = next_arrival, -1
        else:
            break
        num_events += 1
        clock_s[0] = now_s

        if kind == -1:  # arrival
            i = a
            a += 1
            tenant = tenants_l[i]
            while releases and releases[0][0] <= now_s:
                inflight[heapq.heappop(releases)[1]] -= 1
            if routing.policy is Routing.AFFINITY:
                r = -1
                for h in homes[tenant]:
                    if inflight[h] * held_share < routing.occupancy_threshold:
                        r = h
                        break
                if r < 0:
                    loads = [
                        ReplicaLoad(names[j], inflight[j] * held_share, queue_delay[j])
                        for j in range(n_rep)
                    ]
                    decision = choose_replica(
                        tenant_name(tenant),
                        loads,
                        k=routing.k,
                        occupancy_threshold=routing.occupancy_threshold,
                        home_set=[names[h] for h in homes[tenant]],
                    )
                    assert decision is not None
                    r = index_of[decision.replica]
                    spilled[i] = decision.reason == "spill"
            elif routing.policy is Routing.RANDOM:
                r = random_l[i]
            else:
                # The order of `routing.least_loaded`: occupancy, queue delay, name.
                r = min(zip(inflight, queue_delay, range(n_rep), strict=True))[2]
            rep = replicas[r]
            rep_l[i] = r
            inflight[r] += 1
            new_version[i] = rep.version == 1
            pid = prefix_l[i]
            if template_l[i]:
                rep.routed.add(pid)
            chain = chain_l[i] = chain_of(rep.version, tenant, pid)
            found = rep.cache.tier(chain)
            tier_l[i] = found
            if found == TIER_DRAM:
                rep.cache.offer(keys[rep.version][tenant], chain)
                start_fetch(dram_links, TIER_DRAM, r, i, now_s)
            elif found == TIER_NVME:
                rep.cache.offer_nvme(keys[rep.version][tenant], chain)
                start_fetch(nvme_links, TIER_NVME, r, i, now_s)
            else:
                enqueue(r, i, wl.prefix_tokens + wl.suffix_tokens, now_s)

        elif kind == _ARRIVAL_FETCH_DONE:
            r, link_kind = divmod(x, 4)
            links = dram_links if link_kind == TIER_DRAM else nvme_links
            link = links[r]
            if y != link.epoch:
                continue  # superseded: a fetch joined or left since this was scheduled
            for i in link.finish(now_s):
                fetch_s[i] = now_s - arrival_l[i]
                if link_kind == TIER_NVME:  # fetched into DRAM: offered to it
                    v, t = int(new_version[i]), tenants_l[i]
                    replicas[r].cache.offer(keys[v][t], chain_l[i])
                enqueue(r, i, wl.suffix_tokens, now_s)
            done = link.next_done_s()
            if done is not None:
                push(done, _ARRIVAL_FETCH_DONE, x, link.epoch)

        elif kind == _PREFILL_DONE:
            i, r = x, y
            ttft[i] = now_s - arrival_l[i]
            hit = tier_l[i] != TIER_MISS
            if not hit:  # the KV exists now: the replica offers it to its cache
                v, t = int(new_version[i]), tenants_l[i]
                replicas[r].cache.offer(keys[v][t], chain_l[i])
            chain_l[i] = ()  # the request is done with its cache
            if rollout is not None:
                completions.append((now_s, wl.prefix_tokens if hit else 0, bool(new_version[i])))

        elif kind == _SERVER_FREE:
            rep = replicas[x]
            rep.pending_tokens -= y
            update_delay(x)
            rep.busy = False
            if rep.queue:
                start_prefill(x, now_s)

        elif kind == _CONTROL:
            assert rollout is not None
            surge_replica_s += len(surging) * (rollout.surge_factor - 1) * (now_s - last_control_s)
            last_control_s = now_s
            horizon = now_s - max(_BASELINE_WINDOW_S, rollout.gate_window_s)
            while completions and completions[0][0] < horizon:
                completions.popleft()
            if not halted and step_index < 0 and now_s >= rollout.at_s:
                baseline_hit = window_hit_rate(now_s - _BASELINE_WINDOW_S, only_new=False)
                open_step(now_s)
            elif not halted and step_index >= 0:
                recent = window_hit_rate(now_s - rollout.gate_window_s, only_new=True)
                target = (baseline_hit or 0.0) * rollout.gate_hit_ratio
                if (
                    now_s - step_start_s >= rollout.min_dwell_s
                    and recent is not None
                    and recent >= target
                ):
                    events.append(RolloutEvent(now_s, "gate", num_new, recent))
                    close_surge()
                    if step_index + 1 < len(rollout.steps):
                        open_step(now_s)
                    else:
                        halted = True
                elif now_s - step_start_s >= rollout.rollback_after_s:
                    events.append(RolloutEvent(now_s, "rollback", num_new, recent))
                    close_surge()
                    halted = True
            if a < n:
                push(now_s + config.control_interval_s, _CONTROL, 0)

    for i in range(n):
        tier[i] = tier_l[i]
        replica_of[i] = rep_l[i]
    resident = np.array([rep.cache.dram_resident_bytes for rep in replicas], dtype=np.float64)
    routed = np.array([len(rep.routed) * prefix_bytes for rep in replicas], dtype=np.float64)
    return SimResult(
        config=config,
        arrival_s=arrival,
        tenant=tenants,
        prefix_id=prefix_id,
        ttft_s=ttft,
        tier=tier,
        is_template=is_template,
        replica=replica_of,
        spilled=spilled,
        new_version=new_version,
        fetch_s=fetch_s,
        resident_bytes=resident,
        routed_template_bytes=routed,
        rollout_events=events,
        surge_replica_s=surge_replica_s,
        baseline_hit_rate=baseline_hit,
        num_events=num_events,
    )
