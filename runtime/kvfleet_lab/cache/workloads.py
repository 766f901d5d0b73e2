"""Generated request streams of the three prefix populations (docs/design.md §2, R4), for the
side-by-side policy comparison of `kvfleet bench`. Pure, seeded, torch-free.

- `system-prompts`: templates of 200-2,000 tokens (high reuse, Zipf-popular) + a one-shot user
  message of 30-300 tokens;
- `rag`: an app instruction (300 tokens) + a document of 2,000-20,000 tokens (moderate reuse per
  document, Zipf 0.7 over 500 documents) + a one-shot question of 20-200 tokens;
- `agent-loops`: sessions that re-send their whole growing transcript every step: agent loops
  (an agent prompt of 1,000-2,000 tokens, 5-25 steps of 100-600 tokens, a step every 2-6 s) and
  chats (a 500-token system prompt, 2-8 turns of 100-800 tokens, a turn every 10-60 s), half each;
  a transcript is reused only by its own next step and is dead after its last;
- `conversation`: multi-turn chats (issue 16): sessions of 2-30 turns (median 6) arriving as a
  Poisson stream; each turn re-sends the whole history (one of 20 system prompts of 100-1,500
  tokens, Zipf 1.0, then every earlier user message and answer) plus the previous answer
  (50-800 tokens) and a new user message (20-400 tokens); think times between turns are
  log-normal from seconds to many minutes (median 45 s, capped at an hour); a session ends after
  its last turn and its transcript is never sent again;
- `mixed`: the three design populations interleaved in time, a third of the requests each.

Every prompt length is drawn so that it rarely ends on a block boundary. Token ids are
deterministic per segment (segment id, position), so equal segments hash equally and nothing else
does; chains are hashed under `sim.SIM_KEY` exactly as `load_mooncake_trace` does.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from kvfleet_lab.cache.sim import SIM_KEY, TraceRequest
from kvfleet_runtime.cache._keys import BlockHash, continue_chain, key_digest

__all__ = ["WORKLOADS", "Workload", "generate_workload"]

_SEGMENT_TOKENS = 1 << 16
"""Token ids of segment s are s * 2^16 + position: distinct segments never share a block."""


@dataclass(slots=True, frozen=True)
class Workload:
    name: str
    description: str
    requests: list[TraceRequest]


_Segment = tuple[int, int]
"""(segment id, number of tokens)."""


class _Prompts:
    """Chained block hashes of prompts made of segments, memoized per segment prefix so that a
    20,000-token document or a growing transcript is hashed once, not once per request."""

    def __init__(self) -> None:
        self._next_id = 0
        self._memo: dict[tuple[_Segment, ...], tuple[list[BlockHash], list[int]]] = {(): ([], [])}
        self._root = key_digest(SIM_KEY)

    def segment(self, num_tokens: int) -> _Segment:
        assert 0 < num_tokens < _SEGMENT_TOKENS and self._next_id < 2**16
        self._next_id += 1
        return (self._next_id, num_tokens)

    def _chain(
        self, segments: tuple[_Segment, ...], *, keep: bool = True
    ) -> tuple[list[BlockHash], list[int]]:
        """Full-block hashes of the segments' tokens and the partial tail after them."""
        done = self._memo.get(segments)
        if done is not None:
            return done
        hashes, tail = self._chain(segments[:-1])
        seg_id, n = segments[-1]
        tokens = tail + [seg_id * _SEGMENT_TOKENS + i for i in range(n)]
        whole = len(tokens) // 16 * 16
        prev = hashes[-1] if hashes else self._root
        result = (hashes + continue_chain(prev, tokens[:whole]), tokens[whole:])
        if keep:
            self._memo[segments] = result
        return result

    def request(self, t_s: float, segments: tuple[_Segment, ...], *, keep: bool) -> TraceRequest:
        """A request of these segments; `keep`: memoize its whole prompt (it will be extended)."""
        hashes, tail = self._chain(segments, keep=keep)
        return TraceRequest(t_s, len(hashes) * 16 + len(tail), tuple(hashes))


def _zipf_picker(rng: random.Random, n: int, s: float) -> Callable[[], int]:
    order = list(range(n))
    rng.shuffle(order)  # popularity is not correlated with creation order or length
    cum = list(itertools.accumulate(1.0 / (k + 1) ** s for k in range(n)))
    ranks = range(n)
    return lambda: order[rng.choices(ranks, cum_weights=cum)[0]]


def _system_prompts(
    rng: random.Random, prompts: _Prompts, n: int, rate_rps: float
) -> list[TraceRequest]:
    templates = [prompts.segment(rng.randint(200, 2000)) for _ in range(200)]
    pick = _zipf_picker(rng, len(templates), 1.0)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate_rps)
        user = prompts.segment(rng.randint(30, 300))
        out.append(prompts.request(t, (templates[pick()], user), keep=False))
    return out


def _rag(rng: random.Random, prompts: _Prompts, n: int, rate_rps: float) -> list[TraceRequest]:
    instructions = [prompts.segment(300) for _ in range(4)]
    docs = [prompts.segment(rng.randint(2000, 20000)) for _ in range(500)]
    pick = _zipf_picker(rng, len(docs), 0.7)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate_rps)
        doc = pick()
        question = prompts.segment(rng.randint(20, 200))
        out.append(prompts.request(t, (instructions[doc % 4], docs[doc], question), keep=False))
    return out


def _agent_loops(
    rng: random.Random, prompts: _Prompts, n: int, rate_rps: float
) -> list[TraceRequest]:
    agent_prompts = [prompts.segment(rng.randint(1000, 2000)) for _ in range(10)]
    chat_prompt = prompts.segment(500)
    mean_steps = (15 + 5) / 2
    steps: list[tuple[float, int, int]] = []  # (time, session, step)
    sessions: list[tuple[_Segment, list[int], list[float]]] = []
    t = 0.0
    while len(steps) < 2 * n:
        t += rng.expovariate(rate_rps / mean_steps)
        if rng.random() < 0.5:
            head = agent_prompts[rng.randrange(len(agent_prompts))]
            lengths = [rng.randint(100, 600) for _ in range(rng.randint(5, 25))]
            gaps = [rng.uniform(2.0, 6.0) for _ in lengths]
        else:
            head = chat_prompt
            lengths = [rng.randint(100, 800) for _ in range(rng.randint(2, 8))]
            gaps = [rng.uniform(10.0, 60.0) for _ in lengths]
        at = t
        for k, gap in enumerate(gaps):
            steps.append((at, len(sessions), k))
            at += gap
        sessions.append((head, lengths, gaps))
    steps.sort()
    transcripts: dict[int, tuple[_Segment, ...]] = {}
    out = []
    for at, s, k in steps[:n]:
        head, lengths, _ = sessions[s]
        transcript = (*transcripts.get(s, (head,)), prompts.segment(lengths[k]))
        last = k == len(lengths) - 1
        if last:
            transcripts.pop(s, None)
        else:
            transcripts[s] = transcript
        out.append(prompts.request(at, transcript, keep=not last))
    return out


def _conversations(
    rng: random.Random, prompts: _Prompts, n: int, rate_rps: float
) -> list[TraceRequest]:
    system = [prompts.segment(rng.randint(100, 1500)) for _ in range(20)]
    pick = _zipf_picker(rng, len(system), 1.0)
    mean_turns = 8.0  # of the turn-count law below (median 6, clipped to 2-30)
    # Next turn of each live session, by time: (time, seq, session).
    due: list[tuple[float, int, int]] = []
    # Per live session: (transcript so far, its number of turns, the next turn's index).
    sessions: dict[int, tuple[tuple[_Segment, ...], int, int]] = {}
    seq = itertools.count()
    arrival_s = 0.0
    out: list[TraceRequest] = []
    while len(out) < n:
        if not due or arrival_s <= due[0][0]:
            session = next(seq)
            num_turns = min(30, max(2, round(rng.lognormvariate(math.log(6.0), 0.7))))
            sessions[session] = ((system[pick()],), num_turns, 0)
            heapq.heappush(due, (arrival_s, session, session))
            arrival_s += rng.expovariate(rate_rps / mean_turns)
            continue
        at_s, _, session = heapq.heappop(due)
        history, num_turns, turn = sessions[session]
        transcript = (*history, prompts.segment(rng.randint(20, 400)))
        last = turn == num_turns - 1
        out.append(prompts.request(at_s, transcript, keep=not last))
        if last:
            del sessions[session]
            continue
        answer = prompts.segment(rng.randint(50, 800))
        sessions[session] = ((*transcript, answer), num_turns, turn + 1)
        think_s = min(3600.0, rng.lognormvariate(math.log(45.0), 1.3))
        heapq.heappush(due, (at_s + think_s, next(seq), session))
    return out


_POPULATIONS = {
    "system-prompts": (
        _system_prompts,
        "200 system prompts of 200-2,000 tokens (Zipf 1.0) + one-shot user messages",
    ),
    "rag": (
        _rag,
        "500 documents of 2,000-20,000 tokens (Zipf 0.7) after an app instruction + "
        "one-shot questions",
    ),
    "agent-loops": (
        _agent_loops,
        "sessions re-sending their growing transcript: agent loops of 5-25 steps every 2-6 s "
        "and chats of 2-8 turns every 10-60 s",
    ),
}
"""The design's three populations (`mixed` interleaves them)."""
_GENERATED = {
    **_POPULATIONS,
    "conversation": (
        _conversations,
        "multi-turn chats: sessions of 2-30 turns re-sending the whole history plus the last "
        "answer and a new message, think times from seconds to many minutes",
    ),
}

WORKLOADS = (*_GENERATED, "mixed")


def generate_workload(
    name: str, *, num_requests: int, seed: int = 1, rate_rps: float = 4.0
) -> Workload:
    """`num_requests` requests of workload `name` arriving at about `rate_rps` (the Mooncake trace
    runs at ~3.9 rps)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    if num_requests < 1 or rate_rps <= 0:
        raise ValueError(
            f"need num_requests >= 1 and rate_rps > 0, got {num_requests} and {rate_rps}"
        )
    rng = random.Random(f"{name}/{seed}")
    prompts = _Prompts()
    if name != "mixed":
        generate, description = _GENERATED[name]
        return Workload(name, description, generate(rng, prompts, num_requests, rate_rps))
    parts: list[TraceRequest] = []
    for i, (generate, _) in enumerate(_POPULATIONS.values()):
        share = num_requests // 3 + (1 if i < num_requests % 3 else 0)
        if share:
            parts.extend(generate(rng, prompts, share, rate_rps / 3))
    parts.sort(key=lambda r: r.timestamp_s)
    return Workload(name, "the three populations interleaved in time, a third each", parts)
