"""What each vLLM replica holds in its own KV cache, from vLLM's KV events (pure: no sockets).

vLLM publishes its prefix cache's changes (`--kv-events-config`, a ZMQ PUB socket): each message
is three frames, `(topic, seq, payload)`, `seq` an 8-byte big-endian counter starting at 0 when
the engine starts, `payload` a msgpack `KVEventBatch` = `[ts, [event...], dp_rank?]` whose events
are maps tagged by `type` (`vllm/distributed/kv_events.py`):

    BlockStored       block_hashes, parent_block_hash, token_ids, block_size, lora_name,
                      medium, extra_keys (one entry per block: the first carries cache_salt),
                      group_idx
    BlockRemoved      block_hashes, medium, group_idx
    AllBlocksCleared  (reset_prefix_cache)

vLLM's block hashes cannot be computed outside the engine that made them (its chain starts
from a per-process seed), so each stored block is mapped to kvfleet's own chained 16-token
hashes (`cache.continue_chain`) over its tokens, chained onto its parent's: the chain of a
prompt, which the router computes for each request (`prompt_hashes`), then finds the leading
run each replica holds. The chain is rooted at the request's `cache_salt`, which vLLM itself
hashes into a prompt's first block: the router sets it for every request it sends a vLLM
replica (`auth.cache_salt`, the tenant's signed salt), so a chain rooted at tenant A's salt is
never found for tenant B's request, exactly as vLLM's own cache keeps them apart. The root holds
neither weights nor KV dtype: each view is one replica's, so they are that replica's.

Only what a plain request's lookup would hit is kept: blocks of the GPU tier (vLLM's own
cache; `medium` GPU or unset), KV cache group 0, no LoRA, no extra keys but the salt on the
first block (multimodal inputs and prompt embeddings change the KV without the tokens), and a
block size that is a multiple of 16. A block whose parent the view does not hold cannot be
placed on a chain and is left out (counted): the view holds less than vLLM, never more.

What the view cannot know it drops (the replica's matches are then 0 until events rebuild it,
and affinity decides): a sequence gap (ZMQ drops messages past its high-water mark), a
sequence that goes back (the replica restarted), a payload that does not decode, more blocks
than `max_blocks`; the subscriber also drops it when the connection goes away.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from kvfleet_runtime.cache import BlockHash, continue_chain
from kvfleet_runtime.wire import BLOCK_SIZE

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "DropReason",
    "KvEventBatch",
    "KvEventError",
    "KvEventViews",
    "ReplicaKvView",
    "decode_batch",
    "decode_seq",
    "prompt_hashes",
]

_ROOT_PERSON = b"kvfleet-vev-v1"
_GPU_MEDIA = (None, "GPU")
DEFAULT_MAX_BLOCKS = 1 << 20
"""vLLM blocks one view holds at most (a GPU cache of 80 GiB at 16 KiB a block is ~5M tokens
= 330k blocks of 16): past it the publisher is not a vLLM replica we understand."""

ExternalBlockHash = bytes | int
"""vLLM's `ExternalBlockHash`: the hash bytes, or a 64-bit int with
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES."""

DropReason = Literal["gap", "restart", "malformed", "overflow", "disconnected", "cleared"]


class KvEventError(ValueError):
    """A message that is not a vLLM KV event batch."""


class BlockStored(msgspec.Struct, tag=True, frozen=True):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[object] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, frozen=True):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, frozen=True):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventBatch(msgspec.Struct, array_like=True, frozen=True):
    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(KvEventBatch)


def decode_batch(payload: bytes) -> KvEventBatch:
    """A message's payload frame; unknown fields (newer vLLMs add some) are ignored."""
    try:
        return _DECODER.decode(payload)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise KvEventError(f"not a vLLM KV event batch: {exc}") from None


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise KvEventError(f"sequence frame of {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big", signed=True)


def _root(salt: str) -> bytes:
    return hashlib.blake2b(salt.encode(), digest_size=16, person=_ROOT_PERSON).digest()


def prompt_hashes(salt: str, token_ids: Sequence[int]) -> list[BlockHash]:
    """The chain a view is searched with: the full 16-token blocks of a request sent with
    `cache_salt` = `salt`."""
    hashes: list[BlockHash] = continue_chain(_root(salt), token_ids)
    return hashes


@dataclass(slots=True)
class _Node:
    tail: bytes
    """The kvfleet hash after this block's last 16 tokens: its children chain onto it."""
    hashes: tuple[bytes, ...]
    copies: int = 1
    """vLLM may cache one hash in two blocks (two requests computed it at once); each copy is
    stored and removed by its own event."""


@dataclass
class ReplicaKvView:
    """One replica's GPU cache as its events describe it."""

    name: str
    max_blocks: int = DEFAULT_MAX_BLOCKS
    last_seq: int | None = None
    num_events: int = 0
    num_unplaced_blocks: int = 0
    """Stored blocks left out: unknown parent, LoRA, extra keys, another tier or group."""
    drops: Counter[str] = field(default_factory=Counter)
    _nodes: dict[ExternalBlockHash, _Node] = field(default_factory=dict, repr=False)
    _held: Counter[bytes] = field(default_factory=Counter, repr=False)

    @property
    def num_blocks(self) -> int:
        """vLLM blocks held (one per distinct hash)."""
        return len(self._nodes)

    def drop(self, reason: DropReason) -> None:
        """Forget everything (the replica's matches are 0 until events rebuild the view)."""
        self._nodes.clear()
        self._held.clear()
        self.drops[reason] += 1

    def disconnected(self) -> None:
        """The stream went away: what happens before it is back is unknown."""
        self.drop("disconnected")
        self.last_seq = None

    def apply(self, seq: int, batch: KvEventBatch) -> None:
        """One message, in the order received. A gap, or a sequence that goes back (the
        replica restarted: its counter starts at 0 again), drops the view first; the batch
        then starts rebuilding it."""
        if self.last_seq is not None and seq != self.last_seq + 1:
            self.drop("gap" if seq > self.last_seq else "restart")
        self.last_seq = seq
        for event in batch.events:
            self.num_events += 1
            if isinstance(event, BlockStored):
                self._store(event)
            elif isinstance(event, BlockRemoved):
                if event.medium in _GPU_MEDIA and event.group_idx in (None, 0):
                    for h in event.block_hashes:
                        self._remove(h)
            else:
                self.drop("cleared")
            if len(self._nodes) > self.max_blocks:
                self.drop("overflow")

    def malformed(self, seq: int | None) -> None:
        """A message that did not decode: its changes are unknown."""
        self.drop("malformed")
        self.last_seq = seq

    def _store(self, ev: BlockStored) -> None:
        n = len(ev.block_hashes)
        if (ev.medium not in _GPU_MEDIA or ev.group_idx not in (None, 0) or ev.lora_name
                or ev.lora_id or ev.block_size <= 0 or ev.block_size % BLOCK_SIZE
                or len(ev.token_ids) != n * ev.block_size
                or (ev.extra_keys is not None and len(ev.extra_keys) != n)):
            self.num_unplaced_blocks += n
            return
        if ev.parent_block_hash is None:
            tail: bytes | None = None
        else:
            parent = self._nodes.get(ev.parent_block_hash)
            if parent is None:
                self.num_unplaced_blocks += n
                return
            tail = parent.tail
        extra = ev.extra_keys or [None] * n
        for i, h in enumerate(ev.block_hashes):
            keys = extra[i]
            if tail is None:
                # A chain's first block: its only extra key must be the salt.
                if not keys or len(keys) != 1 or not isinstance(keys[0], str) or not keys[0]:
                    self.num_unplaced_blocks += n - i
                    return
                tail = _root(keys[0])
            elif keys:
                self.num_unplaced_blocks += n - i
                return
            node = self._nodes.get(h)
            if node is not None:
                node.copies += 1
                tail = node.tail
                continue
            tokens = ev.token_ids[i * ev.block_size:(i + 1) * ev.block_size]
            hashes = tuple(continue_chain(tail, tokens))
            tail = hashes[-1]
            self._nodes[h] = _Node(tail, hashes)
            self._held.update(hashes)

    def _remove(self, h: ExternalBlockHash) -> None:
        node = self._nodes.get(h)
        if node is None:
            return
        node.copies -= 1
        if node.copies:
            return
        del self._nodes[h]
        self._held.subtract(node.hashes)
        for x in node.hashes:
            if self._held[x] <= 0:
                del self._held[x]

    def matched_blocks(self, hashes: Sequence[bytes]) -> int:
        """How many of `hashes` (a prompt's chain) lead its run in this replica's cache."""
        held = self._held
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n


@dataclass
class KvEventViews:
    """The views of every replica that publishes events."""

    views: dict[str, ReplicaKvView] = field(default_factory=dict)

    def view(self, name: str) -> ReplicaKvView:
        v = self.views.get(name)
        if v is None:
            v = self.views[name] = ReplicaKvView(name)
        return v

    def forget(self, names: Iterable[str]) -> None:
        for name in names:
            self.views.pop(name, None)

    def matched_tokens(self, salt: str, token_ids: Sequence[int],
                       replicas: Mapping[str, object] | None = None) -> dict[str, int]:
        """Leading prompt tokens each replica holds in its own cache (replicas with none are
        left out; `replicas`: only those named)."""
        if not self.views or len(token_ids) < BLOCK_SIZE:
            return {}
        hashes = prompt_hashes(salt, token_ids)
        out = {}
        for name, v in self.views.items():
            if replicas is not None and name not in replicas:
                continue
            n = v.matched_blocks(hashes)
            if n:
                out[name] = n * BLOCK_SIZE
        return out
