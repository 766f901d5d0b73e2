"""Mooncake trace parsing and scaling: exact errors (line number and field) and exact expansion."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfleet_lab.demo import parse_trace, trace_workload
from kvfleet_lab.demo._workload import _sub_block
from kvfleet_lab.traces import DEFAULT_TRACE, TRACES

GOOD = {"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [7, 8]}


def write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    ("bad_line", "expected"),
    [
        ("{not json", "line 2: not valid JSON"),
        ("[1, 2]", "line 2: expected a JSON object"),
        (json.dumps({**GOOD, "hash_ids": "x"}), "line 2: field 'hash_ids' must be a non-empty"),
        (json.dumps({**GOOD, "hash_ids": []}), "line 2: field 'hash_ids'"),
        (json.dumps({**GOOD, "hash_ids": [1, -2]}), "line 2: field 'hash_ids'"),
        (json.dumps({**GOOD, "hash_ids": [1, True]}), "line 2: field 'hash_ids'"),
        (json.dumps({**GOOD, "input_length": 0}), "line 2: field 'input_length' must be"),
        (json.dumps({**GOOD, "input_length": "600"}), "line 2: field 'input_length'"),
        (json.dumps({**GOOD, "input_length": 2000}), "line 2: field 'input_length' (2000) exceeds"),
        (json.dumps({**GOOD, "output_length": -1}), "line 2: field 'output_length'"),
        (json.dumps({**GOOD, "timestamp": "now"}), "line 2: field 'timestamp'"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "hash_ids"}),
         "line 2: field 'hash_ids' is missing"),
    ],
)
def test_a_malformed_line_names_its_number_and_field(
    tmp_path: Path, bad_line: str, expected: str
) -> None:
    path = write(tmp_path, json.dumps(GOOD), bad_line, json.dumps(GOOD))
    with pytest.raises(ValueError) as info:
        parse_trace(path)
    assert expected in str(info.value)
    assert str(path) in str(info.value)


def test_blank_lines_are_skipped_and_line_numbers_stay_true(tmp_path: Path) -> None:
    path = write(tmp_path, json.dumps(GOOD), "", json.dumps({**GOOD, "output_length": None}))
    with pytest.raises(ValueError, match="line 3: field 'output_length'"):
        parse_trace(path)


def test_empty_and_missing_traces(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no requests"):
        parse_trace(write(tmp_path, ""))
    with pytest.raises(ValueError, match="cannot read trace"):
        parse_trace(tmp_path / "nope.jsonl")


def test_expansion_shares_prefixes_exactly_where_hash_ids_do(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        json.dumps({"timestamp": 5, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}),
        json.dumps({"timestamp": 1, "input_length": 700, "output_length": 1, "hash_ids": [1, 3]}),
        json.dumps({"timestamp": 9, "input_length": 100, "output_length": 1, "hash_ids": [4]}),
    )
    wl = trace_workload(path, num_requests=10, num_tenants=3, block_tokens=64,
                        max_prompt_tokens=2000)
    first, second, _ = wl.requests
    # Sorted by timestamp; 512-token blocks scaled to 64 tokens: 700 -> 87, 1024 -> 128.
    assert [len(r.token_ids) for r in wl.requests] == [87, 128, 12]
    assert first.token_ids[:64] == second.token_ids[:64]  # shared root block 1
    assert first.token_ids[64:80] != second.token_ids[64:80]  # blocks 3 vs 2
    assert first.tenant == second.tenant  # one root block, one tenant
    assert all(0 <= t < 256 for r in wl.requests for t in r.token_ids)
    again = trace_workload(path, num_requests=10, num_tenants=3, block_tokens=64,
                           max_prompt_tokens=2000)
    assert again == wl


def test_prompts_are_capped(tmp_path: Path) -> None:
    big = {"timestamp": 0, "input_length": 5120, "output_length": 1, "hash_ids": list(range(10))}
    path = write(tmp_path, json.dumps(big), json.dumps(big))
    wl = trace_workload(path, num_requests=2, num_tenants=1, block_tokens=128,
                        max_prompt_tokens=1000)
    assert [len(r.token_ids) for r in wl.requests] == [1000, 1000]


def test_sampling_keeps_whole_prefix_trees(tmp_path: Path) -> None:
    # Request i (timestamp i) has root block i % 40 and then a block of its own.
    lines = [
        json.dumps({"timestamp": i, "input_length": 1024, "output_length": 1,
                    "hash_ids": [i % 40, 1000 + i]})
        for i in range(400)
    ]
    wl = trace_workload(write(tmp_path, *lines), num_requests=50, num_tenants=4,
                        block_tokens=16, max_prompt_tokens=2000)
    root_of = {tuple(_sub_block(root, 0)): root for root in range(40)}
    kept = [root_of[r.token_ids[:16]] for r in wl.requests]
    assert 1 < len(set(kept)) < 40  # a sample of the roots (1 in 8 expected)
    # Every request of a kept root, in time order, up to the cut at 50 requests.
    expected = [i % 40 for i in range(400) if i % 40 in set(kept)][:50]
    assert kept == expected
    tenants = {root: {r.tenant for r, k in zip(wl.requests, kept, strict=True) if k == root}
               for root in set(kept)}
    assert all(len(t) == 1 for t in tenants.values())  # one root, one tenant


def test_block_tokens_must_be_a_multiple_of_16(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        trace_workload(write(tmp_path, json.dumps(GOOD)), num_requests=1, num_tenants=1,
                       block_tokens=40, max_prompt_tokens=2000)


def test_the_vendored_mooncake_trace_parses() -> None:
    records = parse_trace(DEFAULT_TRACE)
    assert len(records) == 3993


def test_the_vendored_conversation_trace_parses_compressed() -> None:
    records = parse_trace(TRACES["conversation"].path)
    assert len(records) == 12_031
    wl = trace_workload(TRACES["conversation"].path, num_requests=40, num_tenants=2,
                        block_tokens=16, max_prompt_tokens=2000)
    # Every request opens with the same hash id: trees root at the next one, so about 1 in 300 of
    # the conversations is kept (not all or nothing), spread over both tenants.
    assert 10 <= len(wl.requests) <= 40 and {r.tenant for r in wl.requests} == set(wl.tenants)
    assert all(len(r.token_ids) <= 2000 for r in wl.requests)
