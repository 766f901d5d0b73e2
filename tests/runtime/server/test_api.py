"""The replica over HTTP: the openai client, bad input, cache control, probes, metrics, reload."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
import yaml

from kvfleet_runtime.cache import LoadTarget, TierQuery

from .conftest import TEST_CONFIG, RunningReplica, as_router

TENANT = {"X-Kvfleet-Tenant": "acme"}


def client(running: RunningReplica, tenant: str = "acme") -> openai.OpenAI:
    def sign(request: Any) -> None:  # a fresh assertion per request, as the router does
        request.headers.update(as_router({"X-Kvfleet-Tenant": tenant}, request.method,
                                         str(request.url)))

    return openai.OpenAI(base_url=running.base_url + "/v1", api_key="unused", max_retries=0,
                         http_client=openai.DefaultHttpxClient(event_hooks={"request": [sign]}))


@dataclass
class Response:
    status_code: int
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


def http(method: str, url: str, *, data: bytes | Iterable[bytes] | None = None,
         headers: dict[str, str] | None = None, params: dict[str, str] | None = None
         ) -> Response:
    """A stdlib HTTP call that returns 4xx/5xx responses instead of raising."""
    if params:
        url += "?" + urllib.parse.urlencode(params)
    req = urllib.request.Request(url, data=data, headers=as_router(headers or {}, method, url),
                                 method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return Response(resp.status, resp.read().decode())
    except urllib.error.HTTPError as err:
        return Response(err.code, err.read().decode())


def get(url: str, params: dict[str, str] | None = None) -> Response:
    return http("GET", url, params=params)


def post(running: RunningReplica, body: Any, headers: dict[str, str] | None = None,
         path: str = "/v1/completions") -> Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http("POST", running.base_url + path, data=content,
                headers={"Content-Type": "application/json",
                         **(TENANT if headers is None else headers)})


def test_openai_client_token_ids_and_cached_tokens(running: RunningReplica) -> None:
    c = client(running, tenant="openai-ids")
    prompt = [(7 * i + 3) % 256 for i in range(70)]
    def ask() -> Any:
        return c.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0)

    def cached(r: Any) -> int:
        return int(r.usage.prompt_tokens_details.cached_tokens)

    # Sighting 1: not admitted; sighting 2: queued for storing (asynchronously, so the next
    # request may still miss while the copy runs); then requests hit 4 full blocks.
    results = [ask(), ask()]
    assert [cached(r) for r in results] == [0, 0]
    deadline = time.monotonic() + 10
    while cached(results[-1]) == 0:
        assert time.monotonic() < deadline, "the prompt was never stored"
        results.append(ask())
    assert cached(results[-1]) == 64
    texts = {r.choices[0].text for r in results}
    assert len(texts) == 1 and results[0].usage.prompt_tokens == 70  # type: ignore[union-attr]
    assert results[0].choices[0].finish_reason in ("length", "stop")


def test_openai_client_text_prompt_and_seed(running: RunningReplica) -> None:
    c = client(running)
    a = c.completions.create(model="tiny", prompt="Hello, kvfleet!", max_tokens=8,
                             temperature=0.9, seed=42)
    b = c.completions.create(model="tiny", prompt="Hello, kvfleet!", max_tokens=8,
                             temperature=0.9, seed=42)
    assert a.choices[0].text == b.choices[0].text
    assert a.usage is not None and a.usage.prompt_tokens == len("Hello, kvfleet!") + 1  # BOS


def test_openai_client_streaming(running: RunningReplica) -> None:
    c = client(running)
    prompt = [(5 * i) % 256 for i in range(20)]
    whole = c.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
    chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finals[-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 20


def test_openai_client_sees_errors_as_errors(running: RunningReplica) -> None:
    with pytest.raises(openai.NotFoundError):
        client(running).completions.create(model="gpt-4", prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="out of range"):
        client(running).completions.create(model="tiny", prompt=[1, 999], max_tokens=1)


BIG = 70000


@pytest.mark.parametrize(
    ("body", "headers", "status", "needle"),
    [
        ({"prompt": [1, 2]}, {}, 400, "X-Kvfleet-Tenant"),
        ({"prompt": [1, 2]}, {"X-Kvfleet-Tenant": "bad tenant!"}, 400, "does not match"),
        ({"prompt": [1, 2], "n": 9}, None, 400, "n: Input should be less than or equal to 8"),
        ({"prompt": [1, 2], "frobnicate": 1}, None, 400,
         "frobnicate: Extra inputs are not permitted"),
        ({"prompt": [1, 2], "max_tokens": "4"}, None, 400,
         "max_tokens: Input should be a valid integer"),
        ({"prompt": [1, 2], "max_tokens": True}, None, 400, "max_tokens"),
        ({"prompt": [1, 2], "temperature": "hot"}, None, 400, "temperature"),
        ({"prompt": [1, 2], "temperature": 3.5}, None, 400, "temperature: Input should be less"),
        ({"prompt": [1, 300]}, None, 400, "token id 300 is out of range [0, 259)"),
        ({"prompt": [1, -1]}, None, 400, "prompt.1: Input should be greater than or equal to 0"),
        ({"prompt": [1, 2.5]}, None, 400, "prompt.1"),
        ({"prompt": []}, None, 400, "prompt: List should have at least 1 item"),
        ({"prompt": ""}, None, 400, "prompt: String should have at least 1 character"),
        ({"prompt": {"a": 1}}, None, 400, "prompt"),
        ({}, None, 400, "prompt: Field required"),
        ({"prompt": [*range(1, 256), 1, 2]}, None, 400, "prompt has 257 tokens; the limit is 256"),
        ({"prompt": "x" * 300}, None, 400, "prompt has 300 characters"),
        ({"prompt": [1], "max_tokens": 33}, None, 400, "max_tokens 33 exceeds the limit of 32"),
        ({"prompt": [1], "max_tokens": 0}, None, 400, "max_tokens"),
        ({"prompt": [1], "model": "other"}, None, 404, "model 'other' is not served here"),
        ({"prompt": [1], "seed": -1}, None, 400, "seed"),
        ({"prompt": [1], "stream": "yes"}, None, 400, "stream"),
        (b"{not json", None, 400, "not valid JSON"),
        (b"[1, 2]", None, 400, "must be a JSON object, got list"),
        (json.dumps({"prompt": "y" * BIG}).encode(), None, 413, "exceeds the limit of 65536 bytes"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_problem_and_the_server_keeps_serving(
    running: RunningReplica, body: Any, headers: dict[str, str] | None, status: int, needle: str
) -> None:
    resp = post(running, body, headers)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert needle in error["message"]
    ok = post(running, {"prompt": [1, 2, 3], "max_tokens": 1})
    assert ok.status_code == 200


@pytest.mark.parametrize("temperature", [0, 1e-300, 5e-324, 2])
def test_any_allowed_temperature_is_served(running: RunningReplica, temperature: float) -> None:
    resp = post(running, {"prompt": "abc", "max_tokens": 3, "temperature": temperature})
    assert resp.status_code == 200, resp.text


def test_oversized_chunked_body_without_content_length_is_413(running: RunningReplica) -> None:
    def body() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"z" * 4096
        yield b'"}'

    resp = http("POST", running.base_url + "/v1/completions", data=body(),
                headers={**TENANT, "Content-Type": "application/json"})
    assert resp.status_code == 413 and "65536 bytes" in resp.json()["error"]["message"]
    assert post(running, {"prompt": [1], "max_tokens": 1}).status_code == 200


def test_unknown_route_and_method_are_json_errors(running: RunningReplica) -> None:
    resp = get(running.base_url + "/nope")
    assert resp.status_code == 404 and "error" in resp.json()
    resp = get(running.base_url + "/v1/completions")
    assert resp.status_code == 405 and "error" in resp.json()


def test_cache_stats_and_invalidate(running: RunningReplica) -> None:
    prompt = [(11 * i + 1) % 256 for i in range(40)]

    def ask() -> int:
        r = post(running, {"prompt": prompt, "max_tokens": 1}, {"X-Kvfleet-Tenant": "inv"})
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert [ask(), ask()] == [0, 0]
    _wait_for(lambda: ask() == 32)  # stores are asynchronous
    stats = get(running.base_url + "/cache/stats", params={"tenant": "inv"}).json()
    assert stats["tenant"] == "inv" and stats["totals"]["num_hits"] >= 1
    assert stats["totals"]["num_blocks"] >= 2
    assert {t["tier"] for t in stats["tiers"]} == {"t0", "t1"}
    stats_url = running.base_url + "/cache/stats"
    assert get(stats_url, params={"tenant": "a b"}).status_code == 400
    assert get(stats_url, params={"x": "1"}).status_code == 400

    bad = post(running, {"model_version": "latest"}, {}, path="/cache/invalidate")
    assert bad.status_code == 400 and "model_version" in bad.json()["error"]["message"]
    digest = running.replica.loaded.weights_digest
    resp = post(running, {"model_version": digest}, {}, path="/cache/invalidate")
    assert resp.status_code == 202 and resp.json() == {"model_version": digest,
                                                       "status": "accepted"}
    # Invalidation runs in the background after the 202. The replica still serves this digest,
    # so a request racing it may store the prompt again at once: watch the counter, not a miss.
    _wait_for(lambda: get(stats_url, params={"tenant": "inv"}).json()
              ["totals"]["num_invalidated"] >= 2)


def test_metrics_and_probes(running: RunningReplica) -> None:
    post(running, {"prompt": [1, 2, 3], "max_tokens": 1})
    text = get(running.base_url + "/metrics").text
    for name in ("kvfleet_replica_requests_total", "kvfleet_replica_time_to_first_token_seconds",
                 "kvfleet_replica_cached_prompt_tokens_total", "kvfleet_cache_"):
        assert name in text
    assert get(running.base_url + "/healthz").json() == {"status": "ok"}
    ready = get(running.base_url + "/readyz")
    assert ready.status_code == 200 and ready.json()["weights_digest"].startswith("sha256:")
    models = get(running.base_url + "/v1/models").json()
    assert models["data"][0]["id"] == "tiny"


def test_openapi_document(running: RunningReplica) -> None:
    doc = get(running.base_url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    assert {"/v1/completions", "/cache/stats", "/cache/invalidate", "/metrics", "/healthz",
            "/readyz"} <= set(doc["paths"])
    req = doc["components"]["schemas"]["CompletionRequest"]
    assert req["additionalProperties"] is False
    assert req["properties"]["max_tokens"]["maximum"] == 32


def _rewrite_config(running: RunningReplica, text: str) -> None:
    running.config_path.write_text(text)


def _wait_for(predicate: Any, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_config_file_is_reloaded_on_change(running: RunningReplica) -> None:
    replica = running.replica
    try:
        changed = json.loads(json.dumps(TEST_CONFIG))
        changed["limits"]["max_tokens"] = 4
        changed["engine"]["num_kv_blocks"] = 999  # needs a restart: reported, not applied
        changed["engine"]["max_tokens_per_step"] = 256  # live: the engine's next step uses it
        _rewrite_config(running, yaml.safe_dump(changed))
        _wait_for(lambda: replica.config.limits.max_tokens == 4)
        assert replica.restart_pending == ["engine.num_kv_blocks"]
        assert replica.engine.config.max_tokens_per_step == 256
        resp = post(running, {"prompt": [1], "max_tokens": 5})
        assert resp.status_code == 400 and "limit of 4" in resp.text

        before = replica.reloads.labels("rejected")._value.get()  # type: ignore[union-attr]
        _rewrite_config(running, "limits: {max_tokens: -3}\n")
        _wait_for(lambda: replica.reloads.labels("rejected")._value.get() > before)  # type: ignore[union-attr]
        assert replica.config.limits.max_tokens == 4  # the last good config stays
    finally:
        _rewrite_config(running, yaml.safe_dump(TEST_CONFIG))
        _wait_for(lambda: replica.config.limits.max_tokens == 32)


@dataclass
class ExplodingTier:
    """A tier below the cache that fails every call: the HTTP layer never sees it (the engine's
    prepare asks it), and it cannot fail a request."""

    name: str = "t2"
    asked: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)

    def num_matched(self, query: TierQuery) -> int | None:
        self.asked.append((query.key.tenant_id, query.token_ids))
        raise RuntimeError("peer lookup exploded")

    def load_into(self, query: TierQuery, target: LoadTarget,
                  done: Callable[[int], None]) -> None:
        raise AssertionError("never asked to load: it matched nothing")

    def forget(self, query: TierQuery) -> None:
        raise RuntimeError("forget exploded too")


def test_a_failing_lower_tier_sees_valid_prompts_only_and_cannot_fail_a_request(
    running: RunningReplica,
) -> None:
    tier = ExplodingTier()
    engine = running.replica.engine
    prompt = list(range(1, 41))  # two usable blocks: the tiers below the cache are asked
    saved, engine.lower_tiers = engine.lower_tiers, (tier,)
    try:
        ok = post(running, {"prompt": prompt, "max_tokens": 1})
        bad = post(running, {"prompt": [*prompt, 999], "max_tokens": 1})
    finally:
        engine.lower_tiers = saved
    assert ok.status_code == 200 and bad.status_code == 400
    assert tier.asked == [("acme", tuple(prompt))]
