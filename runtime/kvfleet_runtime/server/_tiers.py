"""The replica's local tier hooks on the request path (T3): before a request enters the engine,
what NVMe holds beyond the locally cached prefix is imported (or, in shadow mode, read back and
discarded). The fleet tier's T2 hook (`Replica.before_submit`) runs after it, for what is still
missing. `POST /cache/invalidate` withdraws a weights version from every local tier at once
(`invalidate_local`)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvfleet_runtime.cache import usable_tokens

if TYPE_CHECKING:
    from kvfleet_runtime.server._replica import Replica

__all__ = ["fill_from_nvme", "invalidate_local", "usable_prompt"]


def usable_prompt(token_ids: Sequence[int]) -> list[int]:
    """The whole blocks of a prompt a tier may supply (`usable_tokens`: never the block holding
    the last prompt token, which the engine computes itself)."""
    return list(token_ids[: usable_tokens(len(token_ids))])


async def fill_from_nvme(replica: Replica, tenant: str, token_ids: Sequence[int]) -> int:
    """Blocks imported from T3 for this prompt (0 in shadow mode, when off, or on any failure:
    the engine then prefills)."""
    tier = replica.nvme
    if tier is None or tier.mode == "off" or replica.engine.cache is None:
        return 0
    prompt = usable_prompt(token_ids)
    if not prompt:
        return 0
    key = replica.engine.key_fields.key(tenant)
    return await asyncio.to_thread(tier.fill, key, prompt)


def invalidate_local(replica: Replica, weights_digest: str) -> int:
    """Withdraw a weights version from T0/T1 and T3 (blocking: run it in a thread); returns the
    blocks removed from both. T3 goes first, so that a T3 fill in flight cannot import it into
    the cache after the cache forgot it, and again after, for what T1 evicted into T3 meanwhile."""
    cache, tier = replica.cache, replica.nvme
    removed = 0 if tier is None else tier.invalidate(weights_digest)
    if cache is not None:
        removed += cache.invalidate(weights_digest)
    if tier is not None:
        removed += tier.invalidate(weights_digest)
    return removed
