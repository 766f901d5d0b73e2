"""The replica's OpenAI endpoints: `/v1/completions` and `/v1/chat/completions` over the engine.

A request becomes one engine sequence per (prompt, choice): `n` choices of each prompt of a
batch, choice index `prompt_index * n + j` (OpenAI's order), choice j seeded with `seed + j`.
Each sequence's tokens are decoded incrementally and passed through its `StopMatcher`, so text
is sent only once it cannot be the start of a stop string; a completed stop string cancels the
sequence (its KV blocks are freed at the engine's next step) and ends the choice with
`finish_reason: "stop"`, the stop string itself not returned. Usage counts each prompt once
(not once per choice) and the tokens each choice generated up to its end, stop included.

A client that goes away mid-stream cancels every sequence of the request; it is logged at
DEBUG, never as an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web
from pydantic import BaseModel

from kvfleet_runtime.api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    StopMatcher,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    is_client_gone,
)
from kvfleet_runtime.api._requests import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DetokenizeResponse,
    FinishReason,
    PromptTokensDetails,
    TokenizeResponse,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from kvfleet_runtime.engine import (
    EngineOverloaded,
    EngineShuttingDown,
    GenerationRequest,
    RequestStream,
    SamplingParams,
    TokenEvent,
)
from kvfleet_runtime.tokenizer import ByteTokenizer

if TYPE_CHECKING:
    from kvfleet_runtime.server._state import Replica
    from kvfleet_runtime.tokenizer import IncrementalDecoder

__all__ = ["MIN_TOKENS_CODE", "answer", "chat_completions", "completions", "detokenize",
           "system_fingerprint", "tokenize"]

log = logging.getLogger(__name__)

MIN_TOKENS_CODE = "min_tokens_exceeds_max_tokens"
"""The 400 of `min_tokens` over `max_tokens`: one of the limits JSON Schema cannot state."""


def system_fingerprint(weights_digest: str) -> str:
    """`fp_` and the first 16 hex digits of the weights digest: equal weights, equal print."""
    return "fp_" + weights_digest.partition(":")[2][:16]


@dataclass(slots=True)
class _Prompt:
    index: int
    token_ids: list[int]
    text: str
    """The prompt as text (for `echo`)."""


@dataclass(slots=True)
class _Choice:
    index: int
    prompt: _Prompt
    stream: RequestStream
    matcher: StopMatcher
    decoder: IncrementalDecoder
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    events: list[TokenEvent] = field(default_factory=list)
    """Token events carrying log-probabilities."""
    cached_tokens: int = 0
    cache_tier: str | None = None
    finish_reason: FinishReason | None = None
    done: bool = False
    stop_ids: frozenset[int] = frozenset()
    """Ids that end this sequence: their text is left out unless include_stop is set."""
    include_stop: bool = False
    min_tokens: int = 0


Delta = Callable[["_Choice", str, TokenEvent | None], Awaitable[None]]


# ---- request -> sequences --------------------------------------------------------------------

def _check_model(replica: Replica, model: str | None) -> None:
    if model is not None and model != replica.model_id:
        raise ApiError(404, f"model {model[:80]!r} is not served here; this replica serves "
                       f"{replica.model_id!r}", param="model", code="model_not_found")


def _check_prompt_limit(replica: Replica, token_ids: Sequence[int], param: str) -> None:
    """`max_prompt_tokens` bounds the prompt as sent (rendered, for chat), before any
    `truncate_prompt_tokens`: the limit the published schema states (`maxItems`)."""
    limit, n = replica.config.limits.max_prompt_tokens, len(token_ids)
    if n > limit:
        raise ApiError(400, f"{param} has {n} tokens; the limit is {limit}", param=param,
                       code="prompt_too_long")


def _check_lengths(replica: Replica, token_ids: Sequence[int], max_tokens: int,
                   param: str) -> None:
    limits, context = replica.config.limits, replica.loaded.args.max_seq_len
    n = len(token_ids)
    if max_tokens > limits.max_tokens:
        raise ApiError(400, f"max_tokens {max_tokens} exceeds the limit of {limits.max_tokens}",
                       param="max_tokens", code="invalid_value")
    if n + max_tokens > context:
        raise ApiError(400, f"{param} ({n} tokens) + max_tokens ({max_tokens}) = "
                       f"{n + max_tokens} tokens exceeds the model's context of {context} "
                       f"tokens", param=param, code="context_length_exceeded")


def _truncate(replica: Replica, body: CompletionRequest | ChatCompletionRequest,
              token_ids: list[int], max_tokens: int) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: keep k tokens (-1: what the context leaves beside
    max_tokens), the last ones unless `truncation_side` is "right"."""
    k = body.truncate_prompt_tokens
    if k is None:
        return token_ids
    limits, context = replica.config.limits, replica.loaded.args.max_seq_len
    if k == -1:
        k = max(min(limits.max_prompt_tokens, context - max_tokens), 1)
    elif k > limits.max_prompt_tokens:
        raise ApiError(400, f"truncate_prompt_tokens {k} exceeds the prompt limit of "
                       f"{limits.max_prompt_tokens} tokens", param="truncate_prompt_tokens",
                       code="invalid_value")
    if len(token_ids) <= k:
        return token_ids
    return token_ids[:k] if body.truncation_side == "right" else token_ids[-k:]


def _check_sampling(replica: Replica, body: CompletionRequest | ChatCompletionRequest,
                    max_tokens: int) -> None:
    """What the schema cannot check alone: it needs max_tokens or the vocabulary."""
    if body.min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens {body.min_tokens} exceeds max_tokens {max_tokens}",
                       param="min_tokens", code=MIN_TOKENS_CODE)
    vocab = replica.loaded.args.vocab_size
    bad = [t for t in body.stop_token_ids or () if t >= vocab]
    if bad:
        raise ApiError(400, f"stop_token_ids {bad[:8]} are outside the vocabulary [0, {vocab})",
                       param="stop_token_ids", code="invalid_value")


def _sampling(body: CompletionRequest | ChatCompletionRequest, max_tokens: int,
              logprobs: int | None, j: int) -> SamplingParams:
    seed = None if body.seed is None else (body.seed + j) % (2**63)
    bias = tuple(sorted((int(k), v) for k, v in (body.logit_bias or {}).items()))
    return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, seed=seed,
                          top_p=body.top_p, top_k=max(body.top_k or 0, 0),
                          min_p=body.min_p or 0.0,
                          repetition_penalty=body.repetition_penalty or 1.0,
                          presence_penalty=body.presence_penalty,
                          frequency_penalty=body.frequency_penalty, logit_bias=bias,
                          ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
                          stop_token_ids=frozenset(body.stop_token_ids or ()),
                          logprobs=logprobs)


def _submit(replica: Replica, tenant: str, prompts: list[_Prompt],
            body: CompletionRequest | ChatCompletionRequest, max_tokens: int,
            logprobs: int | None) -> list[_Choice]:
    engine = replica.engine
    gens = [[GenerationRequest(tenant, tuple(p.token_ids), _sampling(body, max_tokens, logprobs,
                                                                     j))
             for j in range(body.n)] for p in prompts]
    for row in gens:
        try:
            engine.check(row[0])  # every prompt before the first submit: a 400 starts nothing
        except ValueError as exc:
            raise ApiError(400, str(exc), param="prompt", code="invalid_value") from exc
    stops = body.stop_list()
    model_stops = frozenset() if body.ignore_eos else engine.config.stop_ids
    stop_ids = model_stops | frozenset(body.stop_token_ids or ())
    choices: list[_Choice] = []
    try:
        for p, row in zip(prompts, gens, strict=True):
            for j, gen in enumerate(row):
                stream = engine.submit(gen)
                decoder = replica.tokenizer.stream_decoder(
                    skip_special_tokens=body.skips_special_tokens(),
                    spaces_between_special_tokens=body.spaces_between_special_tokens)
                matcher = StopMatcher(stops, include_stop=body.include_stop_str_in_output)
                choices.append(_Choice(p.index * body.n + j, p, stream, matcher, decoder,
                                       stop_ids=stop_ids,
                                       include_stop=body.include_stop_str_in_output,
                                       min_tokens=body.min_tokens))
    except BaseException as exc:  # a refusal, or the client went away between two submits
        for c in choices:
            c.stream.cancel()
        if not isinstance(exc, ValueError | EngineOverloaded | EngineShuttingDown):
            raise
        if isinstance(exc, EngineShuttingDown):  # not overload: retrying here cannot help
            raise ApiError(503, str(exc), code="shutting_down") from exc
        if isinstance(exc, EngineOverloaded):
            raise ApiError(503, f"replica overloaded: {exc}", code="overloaded",
                           headers={"Retry-After": "1"}) from exc
        raise ApiError(400, str(exc), param="prompt", code="invalid_value") from exc
    return choices


async def _run_choice(choice: _Choice, on_delta: Delta) -> None:
    """Drive one sequence to its end, passing each piece of safe text to `on_delta`."""
    async for event in choice.stream:
        if isinstance(event, TokenEvent):
            choice.cached_tokens, choice.cache_tier = event.cached_tokens, event.cache_tier
            choice.token_ids.append(event.token_id)
            if event.logprob is not None:
                choice.events.append(event)
            # vLLM's rules: the id that ends the sequence is not text unless asked for, and
            # stop strings count only in the text of tokens after the first min_tokens.
            ends = (event.token_id in choice.stop_ids
                    and len(choice.token_ids) > choice.min_tokens)
            piece = ("" if ends and not choice.include_stop
                     else choice.decoder.push(event.token_id))
            out = choice.matcher.push(piece, check=len(choice.token_ids) > choice.min_tokens)
            choice.text.append(out)
            if choice.matcher.stopped:
                choice.stream.cancel("stop")  # counted as a stop, not as an abort
                choice.finish_reason, choice.done = "stop", True
                await on_delta(choice, out, event)
                return
            await on_delta(choice, out, event)
            continue
        if event.finish_reason == "error":
            raise ApiError(500, event.error or "generation failed", code="generation_failed")
        tail = choice.matcher.push(choice.decoder.flush())
        tail += choice.matcher.flush()
        choice.text.append(tail)
        choice.cached_tokens, choice.cache_tier = event.cached_tokens, event.cache_tier
        choice.finish_reason = "stop" if choice.matcher.stopped else event.finish_reason
        choice.done = True
        await on_delta(choice, tail, None)
        return


async def _run_all(choices: list[_Choice], on_delta: Delta) -> None:
    tasks = [asyncio.create_task(_run_choice(c, on_delta)) for c in choices]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        for c in choices:
            if not c.done:
                c.stream.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)


def _usage(prompts: list[_Prompt], choices: list[_Choice]) -> Usage:
    first = {c.prompt.index: c for c in sorted(choices, key=lambda c: -c.index)}
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    completion = sum(len(c.token_ids) for c in choices)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion,
                 total_tokens=prompt_tokens + completion,
                 prompt_tokens_details=PromptTokensDetails(
                     cached_tokens=sum(c.cached_tokens for c in first.values())))


# ---- log-probabilities -----------------------------------------------------------------------

def _token_bytes(replica: Replica, token_id: int) -> bytes:
    # A token's own bytes: often not a whole character (a byte token, a byte-fallback piece).
    return replica.tokenizer.token_bytes(token_id)


def _token_text(replica: Replica, token_id: int) -> str:
    """The token as text; part of a character is written `bytes:\\xNN` (OpenAI's convention)."""
    raw = _token_bytes(replica, token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _completion_logprobs(replica: Replica, events: list[TokenEvent], offset: int
                         ) -> CompletionLogprobs:
    tokens = [_token_text(replica, e.token_id) for e in events]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=[e.logprob or 0.0 for e in events],
        top_logprobs=[{_token_text(replica, i): lp for i, lp in e.top_logprobs}
                      for e in events],
        text_offset=offsets)


def _chat_logprobs(replica: Replica, events: list[TokenEvent]) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        return TopLogprob(token=_token_text(replica, token_id), logprob=logprob,
                          bytes=list(_token_bytes(replica, token_id)))

    return ChatLogprobs(content=[
        TokenLogprob(token=_token_text(replica, e.token_id), logprob=e.logprob or 0.0,
                     bytes=list(_token_bytes(replica, e.token_id)),
                     top_logprobs=[top(i, lp) for i, lp in e.top_logprobs])
        for e in events], refusal=None)


# ---- the answer's JSON -----------------------------------------------------------------------

def _json(model: BaseModel) -> str:
    """A response model's JSON with the fields the handler set: OpenAI leaves some out (a
    stream's `usage` without `include_usage`, an empty last delta) rather than sending null."""
    return model.model_dump_json(exclude_unset=True)


def answer(model: BaseModel, headers: dict[str, str] | None = None) -> web.Response:
    """A 200 whose body is `model`'s JSON (every answer the replica writes is a protocol
    model's: `kvfleet_runtime.api`, which the OpenAPI document is made from)."""
    return web.Response(text=_json(model), content_type="application/json", headers=headers)


def _sse(data: BaseModel) -> bytes:
    return f"data: {_json(data)}\n\n".encode()


async def _stream(request: web.Request, choices: list[_Choice],
                  chunk: Callable[[_Choice, str, TokenEvent | None], BaseModel | None],
                  opening: list[BaseModel], closing: Callable[[], list[BaseModel]]
                  ) -> web.StreamResponse:
    """Send chunks as choices produce text; a client that goes away cancels everything."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    queue: asyncio.Queue[BaseModel | None] = asyncio.Queue()

    async def on_delta(choice: _Choice, text: str, event: TokenEvent | None) -> None:
        data = chunk(choice, text, event)
        if data is not None:
            queue.put_nowait(data)

    async def produce() -> None:
        try:
            await _run_all(choices, on_delta)
        finally:
            queue.put_nowait(None)

    producer = asyncio.create_task(produce())
    try:
        await resp.prepare(request)
        for first in opening:
            await resp.write(_sse(first))
        while (data := await queue.get()) is not None:
            await resp.write(_sse(data))
        try:
            await producer
        except ApiError as exc:  # an internal failure after the 200 went out: end the stream
            log.error("generation failed mid-stream: %s", exc.message)
            return resp
        for last in closing():
            await resp.write(_sse(last))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except asyncio.CancelledError:  # the client went away (handler cancellation)
        log.debug("client went away mid-stream; cancelling %d sequence(s)", len(choices))
        raise
    except Exception as exc:
        if not is_client_gone(exc):
            raise
        log.debug("client went away mid-stream; cancelling %d sequence(s)", len(choices))
    finally:
        producer.cancel()
        with contextlib.suppress(BaseException):
            await producer
    return resp


# ---- handlers --------------------------------------------------------------------------------

async def completions(replica: Replica, request: web.Request, tenant: str,
                      body: CompletionRequest) -> web.StreamResponse:
    _check_model(replica, body.model)
    tok = replica.tokenizer
    prompts: list[_Prompt] = []
    raw = body.prompt
    if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], str)):
        texts = [raw] if isinstance(raw, str) else [str(t) for t in raw]
        limit = replica.config.limits.max_prompt_tokens
        for i, text in enumerate(texts):
            # A cheap bound before encoding, exact for bytes only (one id per UTF-8 byte, plus
            # BOS); other tokenizers are checked on the ids.
            if isinstance(tok, ByteTokenizer) and len(text) > limit - 1:
                raise ApiError(400, f"prompt has {len(text)} characters; the limit is "
                               f"{limit - 1}", param="prompt", code="prompt_too_long")
            try:
                ids = tok.encode(text, bos=body.add_special_tokens)
            except ValueError as exc:  # text the tokenizer refuses (a lone surrogate)
                raise ApiError(400, f"prompt: {exc}", param="prompt",
                               code="invalid_value") from exc
            prompts.append(_Prompt(i, ids, text))
    else:
        lists = raw if isinstance(raw[0], list) else [raw]
        prompts = [_Prompt(i, [int(t) for t in ids], "") for i, ids in enumerate(lists)]
    _check_sampling(replica, body, body.max_tokens)
    for p in prompts:
        _check_prompt_limit(replica, p.token_ids, "prompt")
        truncated = _truncate(replica, body, p.token_ids, body.max_tokens)
        if truncated is not p.token_ids:
            p.token_ids, p.text = truncated, ""  # echo returns what the model saw
        _check_lengths(replica, p.token_ids, body.max_tokens, "prompt")
        if body.echo and not p.text:
            bad = next((t for t in p.token_ids if t >= replica.loaded.args.vocab_size), None)
            if bad is None:
                p.text = tok.decode(p.token_ids, skip_special_tokens=body.skips_special_tokens())
    choices = _submit(replica, tenant, prompts, body, body.max_tokens, body.logprobs)
    head: dict[str, Any] = {
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
        "created": int(time.time()), "model": replica.model_id,
        "system_fingerprint": system_fingerprint(replica.loaded.weights_digest)}
    want_logprobs = body.logprobs is not None

    if body.stream:
        include_usage = body.include_usage()
        extra: dict[str, Any] = {"usage": None} if include_usage else {}
        offsets = {c.index: len(c.prompt.text) if body.echo else 0 for c in choices}

        def usage_so_far() -> dict[str, Any]:
            return {"usage": _usage(prompts, choices)} if body.continuous_usage() else extra

        def chunk(choice: _Choice, text: str, event: TokenEvent | None
                  ) -> CompletionResponse | None:
            final = event is None or choice.done
            if not text and not final and not (want_logprobs and event is not None):
                return None
            lp = None
            if want_logprobs:
                events = [event] if event is not None and event.logprob is not None else []
                lp = _completion_logprobs(replica, events, offsets[choice.index])
            offsets[choice.index] += len(text)
            ids = [event.token_id] if event is not None else []
            return CompletionResponse(**head, choices=[CompletionChoice(
                index=choice.index, text=text, logprobs=lp,
                finish_reason=choice.finish_reason if final else None, token_ids=ids)],
                **usage_so_far())

        opening: list[BaseModel] = ([CompletionResponse(**head, choices=[CompletionChoice(
            index=c.index, text=c.prompt.text, logprobs=None, finish_reason=None,
            token_ids=[])], **extra) for c in choices] if body.echo else [])

        def closing() -> list[BaseModel]:
            if not include_usage:
                return []
            return [CompletionResponse(**head, choices=[], usage=_usage(prompts, choices))]

        return await _stream(request, choices, chunk, opening, closing)

    async def ignore(choice: _Choice, text: str, event: TokenEvent | None) -> None:
        return None

    await _run_all(choices, ignore)
    out = []
    for c in sorted(choices, key=lambda c: c.index):
        prefix = c.prompt.text if body.echo else ""
        out.append(CompletionChoice(
            index=c.index, text=prefix + "".join(c.text),
            logprobs=_completion_logprobs(replica, c.events, len(prefix))
            if want_logprobs else None,
            finish_reason=c.finish_reason, token_ids=c.token_ids))
    return answer(CompletionResponse(**head, choices=out, usage=_usage(prompts, choices)),
                  _headers(choices))


async def chat_completions(replica: Replica, request: web.Request, tenant: str,
                           body: ChatCompletionRequest) -> web.StreamResponse:
    _check_model(replica, body.model)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        token_ids = replica.tokenizer.encode_chat(messages, add_generation_prompt=True)
    except (ValueError, TypeError, KeyError) as exc:
        raise ApiError(400, f"messages cannot be rendered with the model's chat template: "
                       f"{exc}", param="messages", code="invalid_value") from exc
    _check_prompt_limit(replica, token_ids, "messages")
    max_tokens = body.generation_limit(replica.config.limits.max_tokens)
    explicit = body.max_completion_tokens is not None or body.max_tokens is not None
    if body.truncate_prompt_tokens is not None:
        token_ids = _truncate(replica, body, token_ids, max_tokens if explicit
                              else max(1, body.min_tokens))
    # Without an explicit limit, generation may use what the context leaves (OpenAI's rule).
    if not explicit:
        room = replica.loaded.args.max_seq_len - len(token_ids)
        max_tokens = max(1, min(max_tokens, room))
    _check_sampling(replica, body, max_tokens)
    _check_lengths(replica, token_ids, max_tokens, "messages")
    prompts = [_Prompt(0, token_ids, "")]
    top = (body.top_logprobs or 0) if body.logprobs else None
    choices = _submit(replica, tenant, prompts, body, max_tokens, top)
    head: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
        "model": replica.model_id,
        "system_fingerprint": system_fingerprint(replica.loaded.weights_digest)}

    if body.stream:
        include_usage = body.include_usage()
        extra: dict[str, Any] = {"usage": None} if include_usage else {}
        chunk_head = {**head, "object": "chat.completion.chunk"}

        def chunk(choice: _Choice, text: str, event: TokenEvent | None
                  ) -> ChatCompletionChunk | None:
            final = event is None or choice.done
            has_lp = body.logprobs and event is not None and event.logprob is not None
            if not text and not final and not has_lp:
                return None
            lp = (_chat_logprobs(replica, [event]) if has_lp and event is not None
                  else None)
            delta = ChatDelta(content=text) if text or not final else ChatDelta()
            usage = {"usage": _usage(prompts, choices)} if body.continuous_usage() else extra
            return ChatCompletionChunk(**chunk_head, choices=[ChatChunkChoice(
                index=choice.index, delta=delta, logprobs=lp,
                finish_reason=choice.finish_reason if final else None)], **usage)

        opening: list[BaseModel] = [ChatCompletionChunk(**chunk_head, choices=[ChatChunkChoice(
            index=c.index, delta=ChatDelta(role="assistant", content=""), logprobs=None,
            finish_reason=None)], **extra) for c in choices]

        def closing() -> list[BaseModel]:
            if not include_usage:
                return []
            return [ChatCompletionChunk(**chunk_head, choices=[],
                                        usage=_usage(prompts, choices))]

        return await _stream(request, choices, chunk, opening, closing)

    async def ignore(choice: _Choice, text: str, event: TokenEvent | None) -> None:
        return None

    await _run_all(choices, ignore)
    out = [ChatChoice(index=c.index,
                      message=AssistantMessage(role="assistant", content="".join(c.text),
                                               refusal=None),
                      logprobs=_chat_logprobs(replica, c.events) if body.logprobs else None,
                      finish_reason=_finished(c))
           for c in sorted(choices, key=lambda c: c.index)]
    return answer(ChatCompletionResponse(**head, object="chat.completion", choices=out,
                                         usage=_usage(prompts, choices)), _headers(choices))


def _finished(choice: _Choice) -> FinishReason:
    assert choice.finish_reason is not None, "every choice ends before the answer is written"
    return choice.finish_reason


def _headers(choices: list[_Choice]) -> dict[str, str]:
    head = min(choices, key=lambda c: c.index)
    return {"X-Kvfleet-Cached-Tokens": str(head.cached_tokens),
            "X-Kvfleet-Cache-Tier": head.cache_tier or "none"}


# ---- vLLM's /tokenize and /detokenize ------------------------------------------------------

def tokenize(replica: Replica, body: TokenizeCompletionRequest | TokenizeChatRequest
             ) -> TokenizeResponse:
    """The ids a completion or a chat completion with the same prompt would use (vLLM's
    response: `count`, `max_model_len`, `tokens`, `token_strs`)."""
    _check_model(replica, body.model)
    tok = replica.tokenizer
    try:
        if isinstance(body, TokenizeChatRequest):
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            ids = tok.encode_chat(messages, add_generation_prompt=body.add_generation_prompt)
        else:
            ids = tok.encode(body.prompt, bos=body.add_special_tokens)
    except (ValueError, TypeError, KeyError) as exc:
        param = "messages" if isinstance(body, TokenizeChatRequest) else "prompt"
        raise ApiError(400, f"{param} cannot be tokenized: {exc}", param=param,
                       code="invalid_value") from exc
    strs = [tok.token_text(t) for t in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=replica.loaded.args.max_seq_len,
                            tokens=ids, token_strs=strs)


def detokenize(replica: Replica, body: DetokenizeRequest) -> DetokenizeResponse:
    _check_model(replica, body.model)
    vocab = replica.loaded.args.vocab_size
    bad = next((t for t in body.tokens if t >= vocab), None)
    if bad is not None:
        raise ApiError(400, f"tokens: token id {bad} is out of range [0, {vocab})",
                       param="tokens", code="invalid_value")
    return DetokenizeResponse(prompt=replica.tokenizer.decode(body.tokens))
