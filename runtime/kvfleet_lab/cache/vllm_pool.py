"""Replay a request trace through vLLM's own `BlockPool` (vllm.v1.core.block_pool), request by
request: the baseline users actually have, beside the project's model of it (`sim.simulate_vllm`).

Standalone on purpose: vllm pins its own torch, so this file runs in a separate environment that
has vllm and nothing of kvfleet (stdlib + vllm only). `kvfleet bench policies` runs it as
`<python> vllm_pool.py IN OUT CAPACITY[,CAPACITY...]` where IN holds the requests' chained block
hashes and OUT receives, per capacity, one hit count per request (`blockpool.py` is the caller).
Making the environment (docs/cache.md):

    uv venv ~/.cache/kvfleet/vllm-venv --python 3.11
    uv pip install --python ~/.cache/kvfleet/vllm-venv/bin/python vllm==0.33.0

Per request, as vLLM's scheduler and `KVCacheManager` drive the pool on a sequential replay:
the leading run of cached hashes is the hit (`get_cached_block`), those blocks are taken
(`touch`), the rest get new blocks as far as the free pool goes (`get_new_blocks`, evicting the
free queue's head), all full blocks are cached (`cache_full_blocks`), and the request's blocks are
freed tail first (`free_blocks(reversed(...))`), so its head is the last to go. The pool holds
`capacity + 1` blocks: vLLM keeps one as its null block.

IN format: a little-endian uint32 request count, then per request a uint32 block count and that
many 16-byte hashes. OUT: a JSON object, capacity (as a string) -> hit blocks per request.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HASH_BYTES = 16
BLOCK_SIZE = 16


def write_requests(path: Path, requests: list[tuple[bytes, ...]]) -> None:
    with path.open("wb") as f:
        f.write(struct.pack("<I", len(requests)))
        for blocks in requests:
            f.write(struct.pack("<I", len(blocks)))
            f.write(b"".join(blocks))


def read_requests(path: Path) -> list[list[bytes]]:
    data = path.read_bytes()
    (n,) = struct.unpack_from("<I", data, 0)
    at = 4
    out = []
    for _ in range(n):
        (m,) = struct.unpack_from("<I", data, at)
        at += 4
        out.append([data[at + i * HASH_BYTES : at + (i + 1) * HASH_BYTES] for i in range(m)])
        at += m * HASH_BYTES
    return out


def replay(requests: list[list[bytes]], capacity_blocks: int) -> list[int]:
    from vllm.v1.core.block_pool import BlockPool

    pool: Any = BlockPool(capacity_blocks + 1, enable_caching=True, hash_block_size=BLOCK_SIZE)
    hits = []
    for hashes in requests:
        hit = []
        for h in hashes:
            cached = pool.get_cached_block(h, [0])
            if cached is None:
                break
            hit.append(cached[0])
        hits.append(len(hit))
        pool.touch(hit)
        num_new = min(len(hashes) - len(hit), pool.get_num_free_blocks())
        blocks = hit + pool.get_new_blocks(num_new)
        request = SimpleNamespace(block_hashes=hashes[: len(blocks)])
        pool.cache_full_blocks(request, blocks, len(hit), len(blocks), BLOCK_SIZE, 0)
        pool.free_blocks(reversed(blocks))
    return hits


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        sys.stderr.write("usage: vllm_pool.py IN OUT CAPACITY[,CAPACITY...]\n")
        return 2
    requests = read_requests(Path(argv[1]))
    capacities = [int(c) for c in argv[3].split(",")]
    hits = {str(c): replay(requests, c) for c in capacities}
    Path(argv[2]).write_text(json.dumps(hits))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
