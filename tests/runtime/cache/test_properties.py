"""Property tests: random interleavings of lookup / materialize / store / drain / release /
invalidate / T0 and T1 on and off never free a referenced block, never leak or double-count one,
never return KV whose chain does not match the query, and never cross tenants."""

from __future__ import annotations

import zlib

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfleet_runtime.cache import (
    CacheKey,
    CacheTuning,
    Hit,
    KVLayout,
    PrefixCache,
    Tier,
    block_hashes,
)
from kvfleet_runtime.cache._tier_slots import GONE
from tests.runtime.cache.conftest import DIGEST_A, DIGEST_B, FakeClock, make_key

LAYOUT = KVLayout(num_layers=1, num_kv_heads=2, head_dim=2, dtype="float32")
# A few 16-token "words" so random prompts share prefixes often and diverge at block boundaries.
WORDS = [[w * 100 + i for i in range(16)] for w in range(4)]
prompts = st.lists(st.integers(0, 3), min_size=1, max_size=5).map(
    lambda ws: [t for w in ws for t in WORDS[w]]
)
tails = st.integers(0, 15)
keys = st.builds(
    make_key, st.sampled_from(["tenant-a", "tenant-b"]), st.sampled_from([DIGEST_A, DIGEST_B])
)


def truth(key: CacheKey, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """KV that depends on the key and on every token up to each position, as prefill's does."""
    n = len(tokens)
    k = torch.empty(LAYOUT.num_layers, LAYOUT.num_kv_heads, n, LAYOUT.head_dim)
    seed = zlib.crc32(repr(key).encode())
    for i in range(n):
        seed = zlib.crc32(tokens[i].to_bytes(4, "little"), seed)
        k[:, :, i, :] = float(seed % 100_003)
    return k, -k


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.cache = PrefixCache(
            CacheTuning(
                num_t0_blocks=4,
                num_t1_blocks=5,
                store_queue_max_entries=3,
                thrash_window_s=1.0,
                thrash_sustain_s=2.0,
                thrash_min_blocks=2,
                sketch_width=1024,  # small: collisions are part of what must stay safe
            ),
            LAYOUT,
            clock=self.clock,
        )
        self.held: list[tuple[Hit, list[int]]] = []

    @rule(key=keys, prompt=prompts, tail=tails)
    def lookup(self, key: CacheKey, prompt: list[int], tail: int) -> None:
        tokens = prompt + list(range(900, 900 + tail))
        hit = self.cache.lookup(key, tokens)
        if isinstance(hit, Hit):
            n = hit.matched_tokens
            assert n % 16 == 0 and 0 < n <= len(tokens)
            # The returned chain is exactly the query's chain under this key: no foreign blocks.
            assert list(hit.blocks) == block_hashes(key, tokens)[: n // 16]
            self.held.append((hit, tokens))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100), tp=st.sampled_from([1, 2]))
    def materialize(self, i: int, tp: int) -> None:
        hit, tokens = self.held[i % len(self.held)]
        want_k, want_v = truth(hit.key, tokens[: hit.matched_tokens])
        for rank in range(tp):
            k, v = self.cache.materialize(hit, tp_degree=tp, tp_rank=rank)
            assert torch.equal(k, want_k[:, rank::tp]) and torch.equal(v, want_v[:, rank::tp])

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def release(self, i: int) -> None:
        hit, _ = self.held.pop(i % len(self.held))
        self.cache.release(hit)

    @rule(key=keys, prompt=prompts, tail=tails)
    def store(self, key: CacheKey, prompt: list[int], tail: int) -> None:
        tokens = prompt + list(range(900, 900 + tail))
        self.cache.store(key, tokens, *truth(key, tokens))

    @rule(n=st.integers(1, 3))
    def drain(self, n: int) -> None:
        self.cache.drain_store_queue(max_entries=n)

    @rule(digest=st.sampled_from([DIGEST_A, DIGEST_B]))
    def invalidate(self, digest: str) -> None:
        self.cache.invalidate(digest)

    @rule(on=st.booleans())
    def toggle_t0(self, on: bool) -> None:
        # The fleet config's tiers.t0_device: off demotes T0 into T1 or drops it, under held hits.
        self.cache.set_t0_enabled(on)

    @rule(on=st.booleans())
    def toggle_t1(self, on: bool) -> None:
        self.cache.set_t1_enabled(on)

    @rule(seconds=st.floats(0.0, 3.0))
    def tick(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @invariant()
    def accounting_and_refs(self) -> None:
        held_nodes = [n for hit, _ in self.held for n in hit._path]
        for node in held_nodes:
            assert node.tier != GONE and node.ref_count > 0, "a referenced block was freed"
        self.cache._manager._index.check_invariants(held_nodes)
        stats = self.cache.stats()
        assert sum(t.num_blocks_used for t in stats.tiers) >= stats.num_indexed_blocks
        index = self.cache._manager._index
        if not self.cache.t0_enabled:  # T0 off: nothing reachable lives in T0
            assert all(n.tier != Tier.T0 for n in index.nodes())
        if not self.cache.t1_enabled:
            assert all(n.tier != Tier.T1 for n in index.nodes())


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
