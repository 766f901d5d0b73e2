"""vLLM's real scheduler publishing its KV events (`KVEventsConfig`, vLLM's own
`ZmqEventPublisher`) to the router's subscriber (`kvfleet_runtime.picker._kv_subscriber`): the
wire format as vLLM 0.33 writes it, real block hashes and extra keys; the view finds a salted
prompt's computed blocks under its salt only, and forgets them on `reset_prefix_cache`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not importable here: tests/vllm run in vLLM's own "
                    "environment (make test-vllm)")

import msgspec
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import BlockStored, KVEventBatch

from kvfleet_runtime.picker._kv_events import KvEventViews, decode_batch
from kvfleet_runtime.picker._kv_subscriber import KvEventSubscriber
from tests.vllm import _support as sup

SALT = "acme.0123456789abcdef0123456789abcdef"


def test_vllms_encoding_decodes() -> None:
    ev = BlockStored(block_hashes=[b"\x01" * 32], parent_block_hash=None, token_ids=[1] * 16,
                     block_size=16, lora_id=None, medium="GPU", lora_name=None,
                     extra_keys=[(SALT,)], group_idx=0)
    got = decode_batch(msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=[ev])))
    first = got.events[0]
    assert first.block_hashes == [b"\x01" * 32] and first.extra_keys == [[SALT]]  # type: ignore[union-attr]


async def _until(views: KvEventViews, tokens: list[int], want: dict[str, int],
                 salt: str = SALT) -> None:
    for _ in range(200):
        if views.matched_tokens(salt, tokens) == want:
            return
        await asyncio.sleep(0.05)
    assert views.matched_tokens(salt, tokens) == want


def test_the_schedulers_events_reach_the_view(tiny_checkpoint: Path, tmp_path: Path) -> None:
    vc = sup.vllm_config(tiny_checkpoint, tmp_path / "pool")
    endpoint = f"ipc://{tmp_path / 'events.sock'}"
    vc.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                         endpoint=endpoint)
    s = sup.scheduler(vc)
    views = KvEventViews()
    tokens = [(i * 7) % 500 + 3 for i in range(100)]

    async def run() -> None:
        sub = asyncio.create_task(KvEventSubscriber(views, lambda: {"a": endpoint}).run())
        try:
            await asyncio.sleep(1.0)  # PUB drops what it sends before the SUB is connected
            req = sup.request("r1", tokens, salt=SALT)
            s.add_request(req)
            for _ in range(10):
                out = s.schedule()
                if not out.num_scheduled_tokens:
                    break
                s.update_from_output(out, sup.runner_output(
                    [r for r in s.running if r.request_id in out.num_scheduled_tokens]))
            await _until(views, tokens, {"a": 96})  # every full 16-token block of 100
            assert views.matched_tokens("globex.0123", tokens) == {}
            assert views.matched_tokens(SALT, tokens[:40] + [1] * 60) == {"a": 32}
            assert s.reset_prefix_cache()
            s.update_from_output(s.schedule(), sup.runner_output([]))  # publishes the clear
            await _until(views, tokens, {})
            assert views.views["a"].drops["cleared"] == 1
        finally:
            sub.cancel()
            with pytest.raises(asyncio.CancelledError):
                await sub

    try:
        asyncio.run(run())
    finally:
        s.shutdown()
