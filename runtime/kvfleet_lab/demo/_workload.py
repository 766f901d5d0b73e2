"""The demo's request lists: the built-in workloads and Mooncake-format traces. Pure and seeded.

Built-in populations (docs/design.md §1-§2), lengths in *design tokens* multiplied by `scale` so
that a CPU replica can prefill them in a few minutes:

- `system_prompt`: a tenant's system prompt (200-2,000 tokens; 2 per tenant, high reuse)
  followed by a one-shot question.
- `rag`: a short system prompt, then a document (2,000-4,000 tokens; a tenant's 3 documents are
  drawn by a Zipf law, so reuse is moderate), then a question.
- `conversation`: chat sessions and agent loops that re-send their whole growing transcript each
  turn (user messages, replies, tool outputs appended); a turn goes out after the previous one.

Prompts are token-id lists (byte-level vocabulary 0-255), so no tokenizer runs on the client.
Replies in transcripts are synthetic: the prompts must not depend on what the model answered, so
that the cache-off baseline and the cached run send exactly the same tokens.

Mooncake traces (`kvfleet_lab/traces/README.md`): one JSON object per line with `timestamp` (ms),
`input_length`, `output_length` and `hash_ids` (one id per 512-token block; equal ids at equal
positions = equal prefix). Each id expands into `block_tokens / 16` 16-token blocks of
deterministic ids derived from (hash id, sub-block), the prompt is cut to the scaled input length,
and a request's tenant is its root block (a shared root is a shared system prompt), hashed onto
the demo's tenants. The requests are a sample of whole prefix trees (`trace_workload`).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "POPULATIONS",
    "TENANT_NAMES",
    "TRACE_BLOCK_TOKENS",
    "WORKLOADS",
    "DemoRequest",
    "TraceRecord",
    "Workload",
    "WorkloadSpec",
    "builtin_workload",
    "parse_trace",
    "tenant_names",
    "trace_workload",
]

POPULATIONS = ("system_prompt", "rag", "conversation")
WORKLOADS = {
    "mixed": POPULATIONS,
    "system-prompts": ("system_prompt",),
    "rag": ("rag",),
    "conversations": ("conversation",),
}
"""Built-in workload name -> the populations it draws from."""

TRACE_BLOCK_TOKENS = 512
"""Tokens per `hash_ids` entry in a Mooncake trace."""
_SUB_BLOCK = 16
TENANT_NAMES = ("acme", "initech", "hooli", "globex", "oscorp", "stark")
"""The first tenants' names; their first rendezvous homes on r0..r2 alternate (r1, r2, r0, ...),
so a small demo loads every replica. Further tenants are `tenant-<i>`."""
_VOCAB = 256


@dataclass(frozen=True, slots=True)
class DemoRequest:
    index: int
    tenant: str
    population: str
    token_ids: tuple[int, ...]
    session: str | None = None
    """Requests of one session go out in order, each after the previous one finished."""


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    requests: tuple[DemoRequest, ...]
    tenants: tuple[str, ...]
    description: str

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    num_requests: int = 120
    num_tenants: int = 4
    scale: float = 0.2
    """Multiplies every design length (a 2,000-token prompt becomes 400 at 0.2)."""
    max_prompt_tokens: int = 2000
    seed: int = 1


def tenant_names(n: int) -> tuple[str, ...]:
    return tuple(TENANT_NAMES[i] if i < len(TENANT_NAMES) else f"tenant-{i}" for i in range(n))


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(_VOCAB) for _ in range(max(1, n))]


def _length(rng: random.Random, lo: int, hi: int, scale: float) -> int:
    return max(16, round(rng.randint(lo, hi) * scale))


def builtin_workload(name: str, spec: WorkloadSpec) -> Workload:
    """The named built-in workload; ValueError listing the choices for an unknown name."""
    populations = WORKLOADS.get(name)
    if populations is None:
        raise ValueError(f"unknown workload {name!r}; choose one of: {', '.join(WORKLOADS)}")
    if spec.num_requests < 1 or spec.num_tenants < 1 or spec.scale <= 0:
        raise ValueError(f"workload sizes must be positive, got {spec}")
    rng = random.Random(spec.seed)
    tenants = tenant_names(spec.num_tenants)
    s = spec.scale
    systems = {t: [_tokens(rng, _length(rng, 200, 2000, s)) for _ in range(2)] for t in tenants}
    short_systems = {t: _tokens(rng, _length(rng, 100, 300, s)) for t in tenants}
    docs = {t: [_tokens(rng, _length(rng, 2000, 4000, s)) for _ in range(3)] for t in tenants}
    doc_weights = [1.0 / (i + 1) for i in range(3)]

    # (virtual time, order, tenant, population, tokens, session); sorted by time below.
    items: list[tuple[float, int, str, str, list[int], str | None]] = []
    share = 1.0 / len(populations)
    n = spec.num_requests
    order = 0
    for pop in populations:
        budget = round(n * share) if pop != populations[-1] else n - len(items)
        count = 0
        while count < budget:
            tenant = rng.choice(tenants)
            t = rng.random()
            if pop == "system_prompt":
                prompt = rng.choice(systems[tenant]) + _tokens(rng, _length(rng, 20, 120, s))
                items.append((t, order, tenant, pop, prompt, None))
                count += 1
            elif pop == "rag":
                doc = rng.choices(docs[tenant], weights=doc_weights)[0]
                question = _tokens(rng, _length(rng, 20, 120, s))
                items.append((t, order, tenant, pop, short_systems[tenant] + doc + question, None))
                count += 1
            else:
                agent = rng.random() < 0.5
                turns = min(budget - count, rng.randint(4, 7) if agent else rng.randint(3, 5))
                session = f"s{order}"
                transcript = list(rng.choice(systems[tenant]))
                t = rng.random() * 0.6
                for turn in range(turns):
                    step = (120, 500) if agent else (40, 200)  # tool output / user message
                    transcript += _tokens(rng, _length(rng, *step, s))
                    if turn and len(transcript) > spec.max_prompt_tokens:
                        break  # the context is full: the session ends (the first turn always runs)
                    items.append((t, order, tenant, pop, list(transcript), session))
                    order += 1
                    count += 1
                    transcript += _tokens(rng, _length(rng, 60, 250, s))  # the reply
                    t += 0.4 / turns
            order += 1
    items.sort(key=lambda i: (i[0], i[1]))
    requests = tuple(
        DemoRequest(idx, tenant, pop, tuple(tokens[: spec.max_prompt_tokens]), session)
        for idx, (_, _, tenant, pop, tokens, session) in enumerate(items)
    )
    desc = f"built-in '{name}': {len(requests)} requests, {len(tenants)} tenants, scale {s:g}"
    return Workload(name, requests, tenants, desc)


# ---- Mooncake traces ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceRecord:
    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _field_error(path: Path, line: int, name: str, expected: str, value: object) -> ValueError:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return ValueError(f"{path} line {line}: field '{name}' must be {expected}, got {shown}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_trace(path: Path, *, max_records: int | None = None) -> list[TraceRecord]:
    """Read a Mooncake-format JSONL trace (gzip-compressed if its name ends in .gz). A malformed
    line raises ValueError naming the line number and the field. Blank lines are skipped."""
    try:
        raw_bytes = path.read_bytes()
        if path.name.endswith(".gz"):
            raw_bytes = gzip.decompress(raw_bytes)
        text = raw_bytes.decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read trace {path}: {exc}") from exc
    records: list[TraceRecord] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        if max_records is not None and len(records) >= max_records:
            break
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} line {lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path} line {lineno}: expected a JSON object, got {obj!r:.40}")
        for name in ("timestamp", "input_length", "output_length", "hash_ids"):
            if name not in obj:
                raise ValueError(f"{path} line {lineno}: field '{name}' is missing")
        ts = obj["timestamp"]
        if not isinstance(ts, int | float) or isinstance(ts, bool) or ts < 0:
            raise _field_error(path, lineno, "timestamp", "a number >= 0 (ms)", ts)
        n_in = obj["input_length"]
        if not _is_int(n_in) or n_in < 1:
            raise _field_error(path, lineno, "input_length", "an integer >= 1", n_in)
        n_out = obj["output_length"]
        if not _is_int(n_out) or n_out < 0:
            raise _field_error(path, lineno, "output_length", "an integer >= 0", n_out)
        ids = obj["hash_ids"]
        if (
            not isinstance(ids, list)
            or not ids
            or not all(_is_int(h) and h >= 0 for h in ids)
        ):
            raise _field_error(
                path, lineno, "hash_ids", "a non-empty list of integers >= 0", ids
            )
        if n_in > len(ids) * TRACE_BLOCK_TOKENS:
            raise ValueError(
                f"{path} line {lineno}: field 'input_length' ({n_in}) exceeds the "
                f"{len(ids)} hash_ids x {TRACE_BLOCK_TOKENS} tokens they cover"
            )
        records.append(TraceRecord(lineno, float(ts), n_in, n_out, tuple(ids)))
    if not records:
        raise ValueError(f"{path}: the trace has no requests")
    return records


def _root_hash(root: int, salt: str) -> int:
    digest = hashlib.blake2b(f"{salt}:{root}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _sub_block(hash_id: int, j: int) -> list[int]:
    rng = random.Random(f"mooncake:{hash_id}:{j}")
    return [rng.randrange(_VOCAB) for _ in range(_SUB_BLOCK)]


def _shared_prefix_ids(records: list[TraceRecord]) -> int:
    """How many leading hash ids every record has in common."""
    first = records[0].hash_ids if records else ()
    n = len(first)
    for r in records:
        n = min(n, len(r.hash_ids))
        while n and r.hash_ids[:n] != first[:n]:
            n -= 1
        if not n:
            break
    return n


def trace_workload(
    path: Path,
    *,
    num_requests: int,
    num_tenants: int,
    block_tokens: int,
    max_prompt_tokens: int,
) -> Workload:
    """About `num_requests` requests of a Mooncake trace, sampled by root block, in timestamp
    order; each 512-token block scaled to `block_tokens` tokens (a multiple of 16), prompts capped
    at `max_prompt_tokens`.

    Scaling to fit keeps whole prefix trees: a root block (and so every request under it) is kept
    when a hash of it falls in a 1/m sample, m = (requests in the trace) / `num_requests`
    (spatial sampling, as SHARDS does for cache simulation). The reuse inside each kept tree is
    the trace's own; taking the trace's first N requests instead would replay its cold start only
    (the shared trace's first 120 requests have a 5% infinite-cache hit ratio, the whole 64%).
    """
    if block_tokens < _SUB_BLOCK or block_tokens % _SUB_BLOCK:
        raise ValueError(
            f"--trace-block-tokens must be a positive multiple of 16, got {block_tokens}"
        )
    records = sorted(parse_trace(path), key=lambda r: (r.timestamp_ms, r.line))
    sample = max(1, len(records) // num_requests)
    # The hash ids every request opens with (a system prompt all traffic shares, as in Mooncake's
    # conversation trace) root no tree of their own: trees root at the first id after them.
    shared = _shared_prefix_ids(records)

    def root(r: TraceRecord) -> int:
        return r.hash_ids[min(shared, len(r.hash_ids) - 1)]

    records = [r for r in records if _root_hash(root(r), "sample") % sample == 0]
    records = records[:num_requests]
    if not records:
        raise ValueError(
            f"trace {path.name}: sampling 1 in {sample} of its prefix trees kept no request; "
            f"pass more --requests"
        )
    tenants = tenant_names(num_tenants)
    cache: dict[tuple[int, int], list[int]] = {}
    requests = []
    sub = block_tokens // _SUB_BLOCK
    for idx, rec in enumerate(records):
        length = min(
            max_prompt_tokens, max(1, rec.input_length * block_tokens // TRACE_BLOCK_TOKENS)
        )
        tokens: list[int] = []
        for hid in rec.hash_ids:
            for j in range(sub):
                if len(tokens) >= length:
                    break
                block = cache.get((hid, j))
                if block is None:
                    block = cache[(hid, j)] = _sub_block(hid, j)
                tokens += block
        tenant = tenants[_root_hash(root(rec), "tenant") % num_tenants]
        requests.append(DemoRequest(idx, tenant, "trace", tuple(tokens[:length])))
    desc = (
        f"trace {path.name}: {len(requests)} requests (1/{sample} of its root blocks), "
        f"512-token blocks scaled to {block_tokens}, {num_tenants} tenants by root block"
    )
    return Workload("trace", tuple(requests), tenants, desc)
