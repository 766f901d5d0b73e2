"""The router over fake replicas on loopback: auth, tenant override, homes, spill, streaming,
failover, config watching, the cache-aware override, determinism, no torch."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from kvfleet_runtime.affinity import owner_rank, prefix_key, rendezvous_top_k
from kvfleet_runtime.api import AppRunner
from kvfleet_runtime.cache import CacheKey, block_hashes
from kvfleet_runtime.fleet import EmbeddedHintIndex
from kvfleet_runtime.picker import FleetView, prompt_token_ids
from kvfleet_runtime.router import RouterState, create_router_app
from tests.router.conftest import KEY_FIELDS, KEYS, FakeReplica, StartRouter
from tests.support import free_port

NAMES = [f"r{i}" for i in range(5)]


async def test_requests_need_a_known_api_key(
    replicas: list[FakeReplica], start_router: StartRouter
) -> None:
    router = await start_router(replicas)
    for key in (None, "sk-unknown"):
        status, _headers, body = await router.post({"prompt": "hi"}, key=key)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert sum(len(r.seen) for r in replicas) == 0


async def test_client_cannot_choose_its_tenant_and_key_is_not_forwarded(
    replicas: list[FakeReplica], start_router: StartRouter
) -> None:
    router = await start_router(replicas)
    status, _headers, body = await router.post(
        {"prompt": "hi"}, key="sk-acme", headers={"X-Kvfleet-Tenant": "globex"}
    )
    assert status == 200 and body["tenant"] == "acme"
    seen = next(r for r in replicas if r.seen).seen[0]["headers"]
    assert seen["X-Kvfleet-Tenant"] == "acme" and "Authorization" not in seen


async def test_tenant_lands_on_its_first_home(
    replicas: list[FakeReplica], start_router: StartRouter
) -> None:
    router = await start_router(replicas)
    # Rendezvous ranks r1 first for both; the router knows both tenants (its keys), so their
    # first homes are spread (bounded_home_sets): globex's first home is its second choice.
    assert rendezvous_top_k("acme", NAMES, 1) == rendezvous_top_k("globex", NAMES, 1) == ["r1"]
    for key, home in (("sk-acme", "r1"), ("sk-globex", "r2")):
        for _ in range(5):  # a prompt shorter than a block has no prefix to spread: first home
            status, headers, body = await router.post({"prompt": "x"}, key=key)
            assert status == 200 and body["replica"] == home
            assert headers["X-Kvfleet-Route"] == "home"
            assert headers["X-Kvfleet-Cached-Tokens"] == "0"  # replica headers pass through


async def test_hot_homes_spill_to_least_loaded_and_count_spill_rate(
    replicas: list[FakeReplica], start_router: StartRouter
) -> None:
    homes = rendezvous_top_k("acme", NAMES, 3)
    by_name = {r.name: r for r in replicas}
    for name in homes:
        by_name[name].load["kv_occupancy"] = 0.9
    others = [n for n in NAMES if n not in homes]
    by_name[others[0]].load["kv_occupancy"] = 0.5
    by_name[others[1]].load["kv_occupancy"] = 0.2
    router = await start_router(replicas)
    status, headers, body = await router.post({"prompt": "x"})
    assert status == 200 and body["replica"] == others[1]
    assert headers["X-Kvfleet-Route"] == "spill"
    await router.post({"prompt": "x"}, key="sk-globex")
    async with router.session.get(router.url + "/metrics") as r:
        text = await r.text()
    assert 'kvfleet_router_decisions_total{reason="spill"} 1.0' in text
    # globex has a home under the threshold: it keeps its affinity (no fleet-wide fallback).
    assert router.state.spill_rate == pytest.approx(0.5)
    assert "kvfleet_router_spill_rate 0.5" in text


async def test_a_burst_on_a_hot_home_spills_instead_of_queueing_without_bound(
    replicas: list[FakeReplica], start_router: StartRouter
) -> None:
    for r in replicas:
        r.load["kv_capacity_tokens"] = 100
        r.delay_s = 0.3
    router = await start_router(replicas, k=1)
    home = rendezvous_top_k("acme", NAMES, 1)[0]
    # Each request holds 40 tokens of KV: the home takes two, then the burst spills.
    results = await asyncio.gather(*(router.post({"prompt": "y" * 40}) for _ in range(8)))
    landed = [body["replica"] for status, _, body in results if status == 200]
    assert len(landed) == 8
    assert landed.count(home) <= 3
    routes = [headers["X-Kvfleet-Route"] for _, headers, _ in results]
    assert routes.count("spill") >= 5


async def test_sse_streams_through_in_order(
    replicas: list[FakeReplica], start_router: StartRouter
) -> None:
    router = await start_router(replicas)
    async with router.session.post(
        router.url + "/v1/completions",
        json={"prompt": "x", "stream": True},
        headers={"Authorization": "Bearer sk-acme"},
    ) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        events = []
        async for line in r.content:
            if line.startswith(b"data: "):
                events.append(line[6:].strip())
    assert events[-1] == b"[DONE]"
    assert [json.loads(e)["i"] for e in events[:-1]] == list(range(5))
    assert {json.loads(e)["tenant"] for e in events[:-1]} == {"acme"}


async def test_dead_or_overloaded_replica_is_skipped_with_zero_client_errors(
    replicas: list[FakeReplica], start_router: StartRouter
) -> None:
    router = await start_router(replicas)
    homes = rendezvous_top_k("acme", NAMES, 3)
    by_name = {r.name: r for r in replicas}
    await by_name[homes[0]].stop()  # the router has not polled since: it still looks ready
    by_name[homes[1]].status = 503
    status, _headers, body = await router.post({"prompt": "x"})
    assert status == 200, body
    assert body["replica"] not in homes[:2]
    # After a poll, the dead replica is not ready and not even tried.
    await router.refresh()
    for _ in range(3):
        status, _, body = await router.post({"prompt": "x"})
        assert status == 200 and body["replica"] != homes[0]


async def test_no_ready_replica_is_a_clean_503(
    replicas: list[FakeReplica], start_router: StartRouter
) -> None:
    for r in replicas:
        r.load["ready"] = False
    router = await start_router(replicas)
    status, headers, _body = await router.post({"prompt": "x"})
    assert status == 503 and headers["Retry-After"] == "1"
    async with router.session.get(router.url + "/readyz") as r:
        assert r.status == 503


async def test_config_file_home_sets_and_replicas_are_watched_and_bad_files_ignored(
    replicas: list[FakeReplica], start_router: StartRouter, tmp_path: Path
) -> None:
    path = tmp_path / "fleet.yaml"
    reps = [{"name": r.name, "url": r.url} for r in replicas]
    path.write_text(
        json.dumps({"replicas": reps, "home_sets": {"acme": ["r2", "r0"]}, "generation": 1})
    )
    router = await start_router(replicas[:1], config_path=path)
    await router.refresh()
    status, _, body = await router.post({"prompt": "x"})
    assert body["replica"] == "r2"
    path.write_text("replicas: [this is not valid")
    await asyncio.sleep(0.2)
    status, _, body = await router.post({"prompt": "x"})
    assert status == 200 and body["replica"] == "r2" and router.state.view.config_errors >= 1
    path.write_text(json.dumps({"replicas": reps, "home_sets": {"acme": ["r4"]}, "generation": 2}))
    for _ in range(100):
        await asyncio.sleep(0.05)
        if router.state.view.config is not None and router.state.view.config.generation == 2:
            break
    _status, _, body = await router.post({"prompt": "x"})
    assert body["replica"] == "r4"


async def test_a_fallback_that_left_the_fleet_during_a_try_is_skipped_not_a_500(
    replicas: list[FakeReplica], start_router: StartRouter, tmp_path: Path
) -> None:
    """The pick's failover order is fixed when it is made; the fleet can change while its first
    replica is tried. Here the first one answers 503 after the published config dropped every
    other replica: the router must not look the dropped ones up (a KeyError was a 500), and with
    nobody left says so with a 503."""
    path = tmp_path / "fleet.yaml"
    path.write_text(json.dumps({"replicas": [{"name": r.name, "url": r.url} for r in replicas],
                                "generation": 1}))
    router = await start_router(replicas[:1], config_path=path)
    await router.refresh()

    async def only_me_left(me: FakeReplica) -> None:
        for r in replicas:
            r.before_answer = None
        path.write_text(json.dumps({"replicas": [{"name": me.name, "url": me.url}],
                                    "generation": 2}))
        for _ in range(100):
            config = router.state.view.config
            if config is not None and config.generation == 2:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the router never reloaded the config")

    for r in replicas:
        r.status, r.before_answer = 503, only_me_left
    status, headers, body = await router.post({"prompt": "x"})
    assert status == 503, body
    assert body["error"]["code"] == "no_replica" and headers["Retry-After"] == "1"
    assert sum(len(r.seen) for r in replicas) == 1  # nobody that left was sent the request


async def test_cache_aware_override_prefers_a_warm_replica(
    replicas: list[FakeReplica], start_router: StartRouter
) -> None:
    index = EmbeddedHintIndex()
    router = await start_router(replicas, index=index, recompute_s_per_token=1e-3)
    homes = rendezvous_top_k("acme", NAMES, 3)
    warm = next(n for n in NAMES if n not in homes)
    prompt = "You are a helpful assistant. " * 8
    key = CacheKey("acme", **KEY_FIELDS)
    tokens = prompt_token_ids(prompt, "byte-v1")
    assert tokens is not None
    await index.publish(warm, block_hashes(key, tokens))
    status, headers, body = await router.post({"prompt": prompt})
    assert body["replica"] == warm and headers["X-Kvfleet-Route"] == "warm"
    # The same prompt from another tenant hashes differently: no hint, stays home.
    status, headers, body = await router.post({"prompt": prompt}, key="sk-globex")
    assert status == 200 and headers["X-Kvfleet-Route"] == "home"
    # A warm replica whose queue costs more than the saving is not preferred: the prompt goes
    # to the home that owns its prefix.
    by_name = {r.name: r for r in replicas}
    by_name[warm].load["queue_delay_s"] = 10.0
    await router.refresh()
    _status, headers, body = await router.post({"prompt": prompt})
    prefix = prefix_key("acme", tokens)
    assert prefix is not None
    assert body["replica"] == owner_rank(prefix, homes)[0]


async def test_two_routers_make_the_same_choices(
    replicas: list[FakeReplica], start_router: StartRouter
) -> None:
    replicas[3].load["kv_occupancy"] = 0.95
    a = await start_router(replicas)
    b = await start_router(list(reversed(replicas)))
    for key in ("sk-acme", "sk-globex"):
        for _ in range(3):
            ra = await a.post({"prompt": "z"}, key=key)
            rb = await b.post({"prompt": "z"}, key=key)
            assert ra[2]["replica"] == rb[2]["replica"]


async def test_healthz_models_metrics(
    replicas: list[FakeReplica], start_router: StartRouter
) -> None:
    router = await start_router(replicas)
    async with router.session.get(router.url + "/healthz") as r:
        assert r.status == 200
    async with router.session.get(router.url + "/readyz") as r:
        assert r.status == 200 and (await r.json())["ready_replicas"] == NAMES
    async with router.session.get(
        router.url + "/v1/models", headers={"Authorization": "Bearer sk-acme"}
    ) as r:
        assert r.status == 200 and (await r.json())["data"][0]["id"] == "tiny"
    async with router.session.post(
        router.url + "/v1/completions",
        data=b"{not json",
        headers={"Authorization": "Bearer sk-acme"},
    ) as r:
        assert r.status == 400


def test_prompt_tokens_match_the_replica_tokenizer() -> None:
    from kvfleet_runtime.tokenizer import ByteTokenizer

    for text in ("", "hello", "héllo wörld ✓"):
        assert prompt_token_ids(text, "byte-v1") == ByteTokenizer().encode(text)
    assert prompt_token_ids([1, 2, 3], "anything") == [1, 2, 3]
    assert prompt_token_ids("hello", "sentencepiece") is None


@pytest.mark.parametrize(
    "module",
    [
        "kvfleet_runtime.affinity",
        "kvfleet_runtime.router",
        "kvfleet_runtime.fleet.hint_index",
        "kvfleet_runtime.cli.router",
    ],
)
def test_router_and_routing_core_do_not_import_torch(module: str) -> None:
    code = f"import sys, {module}; sys.exit(1 if 'torch' in sys.modules else 0)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr or f"{module} imported torch"


async def test_upstream_session_is_closed_cleanly(replicas: list[FakeReplica]) -> None:
    # The router's own upstream session (none given), used for a request, then the app shut down:
    # the session and its pooled connections are closed and the state holds no session.
    view = FleetView(static_replicas={r.name: r.url for r in replicas})
    state = RouterState(view=view, keys=KEYS, poll_interval_s=3600, config_poll_s=0.05)
    runner = AppRunner(create_router_app(state))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        upstream = state.session
        assert isinstance(upstream, aiohttp.ClientSession) and not upstream.closed
        async with aiohttp.ClientSession() as client, client.post(
            f"http://127.0.0.1:{port}/v1/completions", json={"model": "tiny", "prompt": "hi"},
            headers={"Authorization": "Bearer sk-acme"},
        ) as r:
            assert r.status == 200, await r.text()
        assert sum(len(rep.seen) for rep in replicas) == 1
    finally:
        await runner.cleanup()
    assert upstream.closed and upstream.connector is None
    assert state.session is None


def test_fleet_view_join_and_leave_move_about_one_nth_of_tenants(tmp_path: Path) -> None:
    from kvfleet_runtime.picker import FleetView

    tenants = [f"t{i}" for i in range(1000)]
    urls = {f"r{i}": f"http://127.0.0.1:{9000 + i}" for i in range(8)}
    path = tmp_path / "fleet.yaml"
    path.write_text(json.dumps({"replicas": [{"name": n, "url": u} for n, u in urls.items()]}))
    view = FleetView(config_path=path)
    assert view.reload_config()
    before = view.computed_home_sets(tenants)
    urls["r8"] = "http://127.0.0.1:9008"
    path.write_text(json.dumps({"replicas": [{"name": n, "url": u} for n, u in urls.items()]}))
    assert view.reload_config()
    after = view.computed_home_sets(tenants)
    moved = sum(before[t][0] != after[t][0] for t in tenants)
    assert 0.6 * 1000 / 9 < moved < 1.4 * 1000 / 9
    # A replica marked not ready in the config leaves the fleet view.
    reps = [{"name": n, "url": u, "ready": n != "r8"} for n, u in urls.items()]
    path.write_text(json.dumps({"replicas": reps}))
    assert view.reload_config()
    assert view.computed_home_sets(tenants) == before
