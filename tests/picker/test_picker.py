"""The picker as both fronts call it: one tokenization per request, the failover order, the
decision's latency on its histogram."""

from __future__ import annotations

from kvfleet_runtime.cache import CacheKey, block_hashes
from kvfleet_runtime.fleet import EmbeddedHintIndex
from kvfleet_runtime.picker import FleetView, KvEventViews, Picker, PickRequest
from kvfleet_runtime.tokenizer import ByteTokenizer
from kvfleet_runtime.wire import LoadReport
from tests.picker.test_kv_events import batch, stored

KEY = ("tiny", "sha256:" + "cd" * 32, "float32", "rope0", "sdpa")
PROMPT = "the same system prompt, long enough for a few blocks of sixteen bytes each. " * 2


class CountingTokenizer(ByteTokenizer):
    """The byte tokenizer under its own name, counting what it encodes."""

    name = "counting-v1"

    def __init__(self) -> None:
        self.num_encodes = 0

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        self.num_encodes += 1
        return super().encode(text, bos=bos)


def mixed_fleet(tokenizer: CountingTokenizer) -> tuple[FleetView, EmbeddedHintIndex,
                                                         KvEventViews]:
    """kvfleet replicas `k0`, `k1` (hint index) and a vLLM replica `v` (KV events)."""
    view = FleetView(static_replicas={"k0": "http://10.0.0.1:8000", "k1": "http://10.0.0.2:8000",
                                      "v": "http://10.0.0.3:8000"},
                     k=1, recompute_s_per_token=1e-3)
    for name in ("k0", "k1"):
        view.replicas[name].report = LoadReport(ready=True, kv_occupancy=0.1, cache_key=KEY,
                                                tokenizer=tokenizer.name)
    view.replicas["v"].report = LoadReport(ready=True, kv_occupancy=0.1)
    return view, EmbeddedHintIndex(), KvEventViews()


async def test_the_prompt_is_tokenized_once_for_the_hint_index_and_the_kv_events() -> None:
    tok = CountingTokenizer()
    view, index, events = mixed_fleet(tok)
    ids = ByteTokenizer().encode(PROMPT)
    await index.publish("k1", block_hashes(CacheKey("acme", *KEY), ids[:32]))
    events.view("v").apply(0, batch(stored([1, 2, 3, 4], None, ids[:128], salt="acme")))
    picker = Picker(view, index=index, kv_events=events, tokenizer=tok)
    pick = await picker.pick(PickRequest("acme", {"prompt": PROMPT}, chat=False))
    assert pick is not None
    # both sources answered, from one encoding of the prompt (the prefix's owner took it too)
    assert await picker.matched_tokens(PickRequest("acme", {"prompt": PROMPT}, False)) == {
        "k1": 32, "v": 128}
    assert tok.num_encodes == 1 + 1  # the pick, then the look above
    assert (pick.replica, pick.reason, pick.matched_tokens) == ("v", "warm", 128)
    assert pick.address == "10.0.0.3:8000"


async def test_the_failover_order_is_the_decision_again_without_the_replicas_before_it() -> None:
    tok = CountingTokenizer()
    view, index, events = mixed_fleet(tok)
    ids = ByteTokenizer().encode(PROMPT)
    await index.publish("k1", block_hashes(CacheKey("acme", *KEY), ids[:32]))
    events.view("v").apply(0, batch(stored([1, 2, 3, 4], None, ids[:128], salt="acme")))
    picker = Picker(view, index=index, kv_events=events, tokenizer=tok, max_fallbacks=2)
    pick = await picker.pick(PickRequest("acme", {"prompt": PROMPT}, chat=False))
    assert pick is not None
    # v holds 128 of the prompt's 154 tokens; without it the tenant's home among k0 and k1
    # (k=1, rendezvous) is k1, which holds 32
    assert [(t.replica, t.reason, t.matched_tokens) for t in pick.targets] == [
        ("v", "warm", 128), ("k1", "home", 32), ("k0", "home", 0)]
    assert pick.fallbacks == ("10.0.0.2:8000", "10.0.0.1:8000")
    without_v = await picker.pick(PickRequest("acme", {"prompt": PROMPT}, False,
                                              exclude=frozenset({"v"})))
    assert without_v is not None and without_v.targets == pick.targets[1:]
    assert tok.num_encodes == 2  # one per pick
    one = Picker(view, index=index, kv_events=events, tokenizer=tok, max_fallbacks=0)
    only = await one.pick(PickRequest("acme", {"prompt": PROMPT}, chat=False))
    assert only is not None and only.fallbacks == () and len(only.targets) == 1


async def test_no_ready_replica_is_no_pick_and_each_pick_is_timed() -> None:
    view, _, _ = mixed_fleet(CountingTokenizer())
    ticks = iter([0.0, 0.0015, 1.0])
    picker = Picker(view, clock=lambda: next(ticks))
    pick = await picker.pick(PickRequest("acme", {"prompt": [1, 2, 3]}, chat=False))
    assert pick is not None and pick.decision_s == 0.0015
    sample = picker.registry.get_sample_value
    assert sample("kvfleet_router_decision_seconds_count") == 1
    assert sample("kvfleet_router_decision_seconds_bucket", {"le": "0.0015"}) == 1
    assert sample("kvfleet_router_decision_seconds_bucket", {"le": "0.001"}) == 0
    for r in view.replicas.values():
        r.report = LoadReport(ready=False)
    assert await picker.pick(PickRequest("acme", {"prompt": [1, 2, 3]}, chat=False)) is None
