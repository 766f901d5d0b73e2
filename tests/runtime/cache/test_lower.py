"""The lower tiers' interface types (`kvfleet_runtime.cache.TierQuery`, `LoadTarget`,
`LowerTier`): records the engine hands to T3 and T2, and the protocol they implement."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvfleet_runtime.cache import (
    BLOCK_SIZE,
    KVLayout,
    LoadTarget,
    LowerTier,
    PagedBlocks,
    TierQuery,
    block_hashes,
    usable_tokens,
)
from tests.runtime.cache.conftest import make_key


def _query(start_block: int = 1) -> TierQuery:
    key = make_key()
    prompt = tuple(range(3 * BLOCK_SIZE + 5))
    chain = tuple(block_hashes(key, prompt[: usable_tokens(len(prompt))]))
    return TierQuery(request_id=7, key=key, token_ids=prompt, chain=chain,
                     start_block=start_block)


def test_a_query_is_a_frozen_value_of_the_usable_chain() -> None:
    query = _query()
    assert len(query.chain) == 3  # 53 tokens: 3 full blocks, the last token's block not usable
    assert query == _query() and hash(query) == hash(_query())
    assert query != _query(start_block=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        query.start_block = 0  # type: ignore[misc]
    assert not hasattr(query, "__dict__")  # slots: one per request per tier, kept small


def test_a_load_target_is_the_engines_pool_and_its_fresh_ids() -> None:
    kv = PagedBlocks.zeros(KVLayout(2, 2, 4, dtype="float32"), 6, torch.device("cpu"))
    ids = kv.take(2)
    assert ids == [0, 1]
    target = LoadTarget(kv, tuple(ids))
    assert target.kv is kv and target.block_ids == (0, 1)
    assert target.kv.kv is not None  # K and V in one allocation: a run lands in one copy
    assert tuple(target.kv.kv.shape) == (2, 2, 6, 2, BLOCK_SIZE, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        target.block_ids = ()  # type: ignore[misc]


def test_the_protocol_names_what_a_tier_implements() -> None:
    assert "name" in LowerTier.__annotations__
    assert {"num_matched", "load_into", "forget"} <= set(vars(LowerTier))
    # A record that has none of it is not a tier (the composition root checks what it wires).
    assert not isinstance(_query(), LowerTier)
