"""The router's view of vLLM replicas' KV events (`picker._kv_events`): decoding vLLM's wire
format, mapping stored blocks onto kvfleet's chain under the request's salt, removals,
and dropping the view on a gap, a restart, a bad payload or a clear."""

from __future__ import annotations

import msgspec
import pytest

from kvfleet_runtime.picker._kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    KvEventError,
    KvEventViews,
    ReplicaKvView,
    decode_batch,
    decode_seq,
    prompt_hashes,
)

# vLLM 0.32's own encoding (msgspec) of KVEventBatch(ts=1.0, events=[BlockStored(block_hashes=
# [b"\x01" * 32], parent_block_hash=None, token_ids=[1, 2], block_size=2, lora_id=None,
# medium="GPU", lora_name=None, extra_keys=[("acme.x",)], group_idx=0), BlockRemoved(
# block_hashes=[5], medium="GPU"), AllBlocksCleared()]), captured from
# vllm.distributed.kv_events (tests/vllm/test_kv_events.py encodes it live).
VLLM_PAYLOAD = (
    b"\x93\xcb?\xf0\x00\x00\x00\x00\x00\x00\x93\x8a\xa4type\xabBlockStored\xacblock_hashes\x91"
    b"\xc4 " + b"\x01" * 32 + b"\xb1parent_block_hash\xc0\xa9token_ids\x92\x01\x02"
    b"\xaablock_size\x02\xa7lora_id\xc0\xa6medium\xa3GPU\xa9lora_name\xc0\xaaextra_keys\x91\x91"
    b"\xa6acme.x\xa9group_idx\x00\x83\xa4type\xacBlockRemoved\xacblock_hashes\x91\x05\xa6medium"
    b"\xa3GPU\x81\xa4type\xb0AllBlocksCleared\xc0"
)
SALT = "acme.0123"
B = 32  # vLLM's block, two of kvfleet's 16-token blocks


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def stored(hashes: list[int], parent: int | None, toks: list[int], *, salt: str | None = SALT,
           **kw: object) -> BlockStored:
    extra: list[list[object] | None] = [None] * len(hashes)
    if parent is None and salt is not None:
        extra[0] = [salt]
    fields: dict[str, object] = {"medium": "GPU", "group_idx": 0, **kw}
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=toks,
                       block_size=B, extra_keys=extra, **fields)  # type: ignore[arg-type]


def batch(*events: BlockStored | BlockRemoved | AllBlocksCleared) -> KvEventBatch:
    return KvEventBatch(ts=0.0, events=list(events))


def held(view: ReplicaKvView, toks: list[int], salt: str = SALT) -> int:
    return view.matched_blocks(prompt_hashes(salt, toks)) * 16


def test_vllms_own_payload_decodes() -> None:
    got = decode_batch(VLLM_PAYLOAD)
    assert got.ts == 1.0 and got.data_parallel_rank is None
    first, removed, cleared = got.events
    assert isinstance(first, BlockStored) and first.block_hashes == [b"\x01" * 32]
    assert first.extra_keys == [["acme.x"]] and first.token_ids == [1, 2]
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [5]
    assert isinstance(cleared, AllBlocksCleared)


@pytest.mark.parametrize("payload", [b"", b"\x93", msgspec.msgpack.encode([1.0, [{"type": "X"}]]),
                                     msgspec.msgpack.encode({"ts": 1})])
def test_a_payload_that_is_not_a_batch_is_refused(payload: bytes) -> None:
    with pytest.raises(KvEventError):
        decode_batch(payload)


def test_sequence_frame() -> None:
    assert decode_seq((7).to_bytes(8, "big")) == 7
    with pytest.raises(KvEventError, match="4 bytes"):
        decode_seq(b"\x00" * 4)


def test_stored_blocks_chain_onto_their_parent_under_the_salt() -> None:
    view = ReplicaKvView("a")
    p = tokens(3 * B)
    view.apply(0, batch(stored([10, 11], None, p[: 2 * B])))
    view.apply(1, batch(stored([12], 11, p[2 * B:])))
    assert view.num_blocks == 3
    assert held(view, p) == 3 * B
    assert held(view, p + tokens(40, 900)) == 3 * B  # a longer prompt: the leading run
    assert held(view, p[:B] + tokens(2 * B, 900)) == B  # diverges after block 1
    assert held(view, p, salt="globex.4567") == 0  # another tenant's salt finds nothing
    # the chain is kvfleet's own: the same as hashing the whole prompt at once
    assert prompt_hashes(SALT, p)[:2] == prompt_hashes(SALT, p[:B])


def test_removal_cuts_the_run_and_copies_are_counted() -> None:
    view = ReplicaKvView("a")
    p = tokens(2 * B)
    view.apply(0, batch(stored([10, 11], None, p)))
    view.apply(1, batch(stored([11], 10, p[B:])))  # a second copy of block 11
    view.apply(2, batch(BlockRemoved(block_hashes=[11], medium="GPU")))
    assert held(view, p) == 2 * B  # one copy is left
    view.apply(3, batch(BlockRemoved(block_hashes=[11, 999], medium="GPU")))
    assert held(view, p) == B
    view.apply(4, batch(BlockRemoved(block_hashes=[10], medium="CPU")))  # another tier
    assert held(view, p) == B
    view.apply(5, batch(BlockRemoved(block_hashes=[10], medium="GPU")))
    assert held(view, p) == 0 and view.num_blocks == 0


@pytest.mark.parametrize("event", [
    stored([10], None, tokens(B), salt=None),  # no salt: not a request of the router's
    stored([10], None, tokens(B), lora_name="adapter"),
    stored([10], None, tokens(B), medium="CPU"),
    stored([10], None, tokens(B), group_idx=1),
    stored([10], 77, tokens(B)),  # its parent was never seen
    BlockStored(block_hashes=[10], parent_block_hash=None, token_ids=tokens(24), block_size=24,
                extra_keys=[[SALT]]),  # not whole 16-token blocks
    BlockStored(block_hashes=[10], parent_block_hash=None, token_ids=tokens(B), block_size=B,
                extra_keys=[[SALT, ["mm-hash", 0]]]),  # multimodal: KV not from tokens alone
    BlockStored(block_hashes=[10, 11], parent_block_hash=None, token_ids=tokens(B),
                block_size=B, extra_keys=[[SALT], None]),  # tokens for one block only
])
def test_blocks_a_plain_lookup_would_not_hit_are_left_out(event: BlockStored) -> None:
    view = ReplicaKvView("a")
    view.apply(0, batch(event))
    assert view.num_blocks == 0 and view.num_unplaced_blocks == len(event.block_hashes)
    assert held(view, tokens(B)) == 0


def test_a_block_with_extra_keys_ends_the_chain_there() -> None:
    view = ReplicaKvView("a")
    p = tokens(2 * B)
    ev = BlockStored(block_hashes=[10, 11], parent_block_hash=None, token_ids=p, block_size=B,
                     extra_keys=[[SALT], ["mm-hash", 0]])
    view.apply(0, batch(ev))
    assert held(view, p) == B and view.num_unplaced_blocks == 1


@pytest.mark.parametrize("seq, reason", [(5, "gap"), (1, "restart"), (0, "restart")])
def test_a_gap_or_a_restart_drops_the_view_then_rebuilds(seq: int, reason: str) -> None:
    view = ReplicaKvView("a")
    p, q = tokens(B), tokens(B, 500)
    view.apply(1, batch(stored([10], None, p)))
    view.apply(2, batch())
    view.apply(seq, batch(stored([20], None, q)))
    assert view.drops == {reason: 1}
    assert held(view, p) == 0 and held(view, q) == B
    view.apply(seq + 1, batch())
    assert view.drops == {reason: 1}


def test_cleared_and_malformed_and_overflow_drop_the_view() -> None:
    view = ReplicaKvView("a", max_blocks=2)
    p = tokens(3 * B)
    view.apply(0, batch(stored([10], None, p[:B]), AllBlocksCleared()))
    assert view.num_blocks == 0 and view.drops["cleared"] == 1
    view.apply(1, batch(stored([10], None, p[:B])))
    view.malformed(2)
    assert view.num_blocks == 0 and view.drops["malformed"] == 1
    view.apply(3, batch(stored([10, 11, 12], None, p)))
    assert view.num_blocks == 0 and view.drops["overflow"] == 1
    view.apply(4, batch(stored([10], None, p[:B])))
    view.disconnected()
    assert view.num_blocks == 0 and view.last_seq is None
    view.apply(100, batch())  # after a reconnect any sequence is the start
    assert view.drops["gap"] == 0


def test_views_answer_per_replica() -> None:
    views = KvEventViews()
    p = tokens(2 * B)
    views.view("a").apply(0, batch(stored([10, 11], None, p)))
    views.view("b").apply(0, batch(stored([10], None, p[:B])))
    assert views.matched_tokens(SALT, p) == {"a": 2 * B, "b": B}
    assert views.matched_tokens(SALT, p, {"b": None}) == {"b": B}
    assert views.matched_tokens(SALT, p[:15]) == {}
    views.forget(["a"])
    assert views.matched_tokens(SALT, p) == {"b": B}


def test_the_router_subscribes_to_vllm_replicas_and_takes_the_larger_match(tmp_path) -> None:
    import asyncio

    from kvfleet_runtime.affinity import ApiKeyMap
    from kvfleet_runtime.auth import cache_salt
    from kvfleet_runtime.config.fleet import FleetConfig, ReplicaEndpoint, dump_fleet_config
    from kvfleet_runtime.picker import FleetView, PickRequest
    from kvfleet_runtime.picker._picker import larger_match
    from kvfleet_runtime.router import RouterState

    config = tmp_path / "fleet.json"
    config.write_text(dump_fleet_config(FleetConfig(recompute_s_per_token=1e-3, replicas=(
        ReplicaEndpoint(name="a", url="http://10.0.0.1:8000", engine="vllm"),
        ReplicaEndpoint(name="b", url="http://[fd00::2]:8000", engine="vllm"),
        ReplicaEndpoint(name="k", url="http://10.0.0.3:8000")))))
    secret = b"router-secret"
    state = RouterState(view=FleetView(config_path=config), keys=ApiKeyMap({}),
                        router_secret=secret, kv_events=KvEventViews(), kv_events_port=5557,
                        kv_event_endpoints={"b": "ipc:///run/b.sock"})
    assert state.view.reload_config()
    # vLLM replicas only; an explicit endpoint wins
    assert state.picker.kv_event_endpoints() == {"a": "tcp://10.0.0.1:5557",
                                                 "b": "ipc:///run/b.sock"}
    p = tokens(2 * B)
    assert state.kv_events is not None
    state.kv_events.view("a").apply(0, batch(stored([10, 11], None, p,
                                                    salt=cache_salt(secret, "acme"))))
    held = asyncio.run(state.picker.matched_tokens(PickRequest("acme", {"prompt": p}, False)))
    assert held == {"a": 2 * B}
    assert larger_match({"a": 16, "b": 48}, held) == {"a": 2 * B, "b": 48}
    globex = PickRequest("globex", {"prompt": p}, False)
    assert asyncio.run(state.picker.matched_tokens(globex)) == {}
