"""The vendored traces: what they hold, how `--trace` names them, and the compressed one read as
the plain one would be."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from kvfleet_lab.cache.compare import compare_policies
from kvfleet_lab.cache.sim import MOONCAKE_BLOCKS_PER_HASH_ID, load_mooncake_trace
from kvfleet_lab.traces import DEFAULT_TRACE, TRACES, resolve_trace, trace_label
from kvfleet_runtime.cache import BLOCK_SIZE
from tests.lab.cache.test_sim import write_trace

CONVERSATION = TRACES["conversation"].path


def conversation_rows() -> list[dict[str, Any]]:
    with gzip.open(CONVERSATION, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_the_conversation_trace_is_mooncakes_whole_release() -> None:
    rows = conversation_rows()
    # Mooncake's FAST'25 README: 12,031 requests, average input 12,035 and output 343 tokens,
    # timestamps from one hour of online traffic.
    assert len(rows) == 12_031
    assert all(set(r) == {"timestamp", "input_length", "output_length", "hash_ids"} for r in rows)
    assert round(sum(int(r["input_length"]) for r in rows) / len(rows)) == 12_035
    assert round(sum(int(r["output_length"]) for r in rows) / len(rows)) == 343
    stamps = [int(r["timestamp"]) for r in rows]
    assert stamps == sorted(stamps) and 3_000_000 < stamps[-1] <= 3_600_000


def test_every_hash_id_of_the_conversation_trace_has_one_prefix() -> None:
    # The loader chains a hash id's blocks once, onto the id before its first sighting: right only
    # if an id never follows two different prefixes (else a hit would be another prompt's KV).
    before: dict[int, int | None] = {}
    for row in conversation_rows():
        prev = None
        for hash_id in row["hash_ids"]:
            assert before.setdefault(hash_id, prev) == prev, hash_id
            prev = hash_id


def test_a_slice_of_the_conversation_trace_loads_as_chained_blocks() -> None:
    rows = conversation_rows()[:50]
    requests = load_mooncake_trace(CONVERSATION, max_requests=50)
    assert len(requests) == 50
    for row, r in zip(rows, requests, strict=True):
        n_in, ids = int(row["input_length"]), list(row["hash_ids"])
        assert r.num_tokens == n_in and r.timestamp_s == int(row["timestamp"]) / 1000
        assert len(r.blocks) == min(n_in // BLOCK_SIZE, len(ids) * MOONCAKE_BLOCKS_PER_HASH_ID)
    # Requests that open with the same hash ids share exactly those blocks, and no more.
    a, b = rows[0]["hash_ids"], rows[1]["hash_ids"]
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    n = shared * MOONCAKE_BLOCKS_PER_HASH_ID
    assert shared >= 1 and requests[0].blocks[:n] == requests[1].blocks[:n]
    assert requests[0].blocks[n] != requests[1].blocks[n]


def test_a_slice_replays_through_the_policy_comparison() -> None:
    requests = load_mooncake_trace(CONVERSATION, max_requests=60)
    report = compare_policies([("trace", "conversation slice", requests)], [0.03, 0.3])
    (workload,) = report.workloads
    assert workload.num_requests == 60
    for row in workload.rows:
        best = row.figures["belady"].num_hit_tokens
        assert row.figures["no-cache"].num_hit_tokens == 0
        for policy in ("vllm", "radix", "kvfleet"):
            assert 0 <= row.figures[policy].num_hit_tokens <= best
        assert 0 < best <= row.figures["infinite"].num_hit_tokens
    # The slice's infinite cache hits what its shared prefixes say, by hand from the rows: per
    # hash-id prefix, how many of its 32 blocks some earlier request stored.
    stored: dict[tuple[int, ...], int] = {}
    hits = 0
    for r, row in zip(requests, conversation_rows()[:60], strict=True):
        ids = tuple(row["hash_ids"])
        hit, counting = 0, True
        per_id = MOONCAKE_BLOCKS_PER_HASH_ID
        for j in range(len(ids)):
            wanted = min(per_id, len(r.blocks) - j * per_id)
            if wanted <= 0:
                break
            have = stored.get(ids[: j + 1], 0)
            if counting:
                hit += min(have, wanted)
                counting = have >= wanted
            stored[ids[: j + 1]] = max(have, wanted)
        hits += hit * BLOCK_SIZE
    assert workload.rows[0].figures["infinite"].num_hit_tokens == hits > 0


def test_a_compressed_trace_reads_as_the_plain_one(tmp_path: Path) -> None:
    rows = [(0, 1100, [7, 8, 9]), (5, 530, [7, 4])]
    plain = write_trace(tmp_path / "t.jsonl", rows)
    packed = tmp_path / "t.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert load_mooncake_trace(packed) == load_mooncake_trace(plain)
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(packed.read_bytes()[:-12])
    with pytest.raises(ValueError, match=r"broken\.jsonl\.gz: not a readable Mooncake trace"):
        load_mooncake_trace(broken)
    not_gzip = tmp_path / "plain.jsonl.gz"
    not_gzip.write_bytes(plain.read_bytes())
    with pytest.raises(ValueError, match="not a readable Mooncake trace"):
        load_mooncake_trace(not_gzip)


def test_traces_by_name_or_path(tmp_path: Path) -> None:
    assert resolve_trace("synthetic") == DEFAULT_TRACE
    assert resolve_trace("conversation") == CONVERSATION and CONVERSATION.is_file()
    own = write_trace(tmp_path / "own.jsonl", [(0, 600, [1])])
    assert resolve_trace(str(own)) == own
    assert trace_label(CONVERSATION) == "Mooncake conversation trace"
    assert trace_label(own) == "Mooncake-format trace"
    with pytest.raises(ValueError, match=r"'chat' is neither a vendored trace \(synthetic, "):
        resolve_trace("chat")


def test_the_notice_names_each_vendored_file_its_source_and_license() -> None:
    notice = (CONVERSATION.parent / "README.md").read_text()
    for upstream in ("synthetic_trace.jsonl", "conversation_trace.jsonl"):
        assert f"FAST25-release/traces/{upstream}" in notice
    for vendored in TRACES.values():
        assert f"`{vendored.file}`" in notice
    assert "Apache License 2.0" in notice
