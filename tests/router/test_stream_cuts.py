"""A replica's stream cut after its first token, at every byte offset of an event (issue 44 item
5), through a real router on loopback: the client gets only whole events, then the router's
error event on its own; the official `openai` client raises `APIError` (not `JSONDecodeError`)."""

from __future__ import annotations

import json
import random

import openai
import pytest

from kvfleet_runtime.router._sse import EventTooLarge, SseEvents, data_lines
from tests.router.conftest import CUT_EVENT, FakeReplica, StartRouter

EVENTS = [b"data: {\"a\": 1}\n\n", b": a comment\n\n", b"event: x\r\ndata: 2\r\n\r\n",
          b"data: 3\rdata: 4\n\r\n", b"data: 5\r\r", b"data: [DONE]\n\n"]
STREAM = b"".join(EVENTS)
"""Events with every line end the SSE spec allows (LF, CRLF, CR, mixed)."""


def whole_events(data: bytes) -> list[bytes]:
    """What the relay forwards of `data`: the events wholly inside it (by construction)."""
    out, pos = [], 0
    for event in EVENTS:
        if pos + len(event) > len(data):
            break
        out.append(event)
        pos += len(event)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_every_cut_of_a_stream_yields_exactly_the_whole_events_before_it(seed: int) -> None:
    rng = random.Random(seed)
    for cut in range(len(STREAM) + 1):
        data = STREAM[:cut]
        framer = SseEvents()
        got: list[bytes] = []
        pos = 0
        while pos < len(data):  # in random pieces, as TCP delivers them
            step = rng.randint(1, 7)
            got += framer.feed(data[pos:pos + step])
            pos += step
        expected = whole_events(data)
        # an event that ends in a lone CR is complete only once the next byte says it is not a
        # CRLF: at the very end of the data it is still held
        if got != expected:
            assert data.endswith(b"\r") and got == expected[:-1], (cut, got)
        assert b"".join(got) + framer.partial == data, cut


def test_an_event_without_an_end_is_bounded() -> None:
    framer = SseEvents(max_event_bytes=100)
    assert framer.feed(b"data: " + b"x" * 90) == []
    with pytest.raises(EventTooLarge):
        framer.feed(b"x" * 20)


def test_data_lines_follow_the_spec() -> None:
    assert data_lines(b"data: a\ndata:b\ndata\nid: 1\n\n") == [b"a", b"b", b""]
    assert data_lines(b"data: x\r\ndata: y\r\r") == [b"x", b"y"]


def _sse_events(body: bytes) -> list[bytes]:
    framer = SseEvents()
    events = framer.feed(body)
    assert framer.partial == b"", f"the client got a partial event: {framer.partial!r}"
    return events


@pytest.mark.parametrize("cut_at", range(len(CUT_EVENT) + 1))
async def test_a_stream_cut_inside_an_event_reaches_the_client_as_whole_events_then_the_error(
    start_router: StartRouter, cut_at: int
) -> None:
    # Fails on 8a5e244 for every cut_at inside the event: the partial bytes went to the client
    # and the error event was glued onto them (`data: {"id":"c","obj` + `data: {"error"...`).
    replica = FakeReplica("r0", fault="cut_mid_event", cut_at=cut_at)
    await replica.start()
    try:
        router = await start_router([replica])
        await router.refresh()
        async with router.session.post(router.url + "/v1/completions",
                                       json={"prompt": "hi", "stream": True},
                                       headers={"Authorization": "Bearer sk-acme"}) as r:
            assert r.status == 200
            body = await r.read()
        events = _sse_events(body)
        payloads = [json.loads(d) for e in events for d in data_lines(e)]
        assert [p.get("choices", [{}])[0].get("text") for p in payloads[:-1]][1:] == (
            ["he", "llo", "!"] if cut_at == len(CUT_EVENT) else ["he", "llo"])
        assert payloads[-1]["error"]["code"] == "upstream_failed", payloads[-1]
    finally:
        await replica.stop()


@pytest.mark.parametrize("cut_at", [0, 10, 20, len(CUT_EVENT) - 1])
async def test_the_openai_client_raises_its_api_error_on_a_cut_stream(
    start_router: StartRouter, cut_at: int
) -> None:
    # Fails on 8a5e244: json.JSONDecodeError out of the client's stream iterator.
    replica = FakeReplica("r0", fault="cut_mid_event", cut_at=cut_at)
    await replica.start()
    try:
        router = await start_router([replica])
        await router.refresh()
        client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="sk-acme",
                                    max_retries=0)
        texts = []
        with pytest.raises(openai.APIError) as raised:
            stream = await client.completions.create(model="tiny", prompt="hi", stream=True)
            async for chunk in stream:
                texts.append(chunk.choices[0].text)
        assert "mid-stream" in str(raised.value)
        assert texts == [None, "he", "llo"], texts  # the role chunk, then the two tokens
        await client.close()
    finally:
        await replica.stop()
