"""Keys and chained block hashes: fixed vectors, chaining, validation, process independence."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet_runtime.cache import BLOCK_SIZE, CacheKey, block_hashes
from kvfleet_runtime.cache._keys import ChainMemo, iter_block_hashes, key_digest, platform_key
from tests.runtime.cache.conftest import make_key

KEY = CacheKey(
    "tenant-a", "llama-3-8b", "sha256:" + "0123456789abcdef" * 4, "float16", "rope-1", "sdpa-v1"
)

# Pinned once; a change here means every cache in the fleet would miss after an upgrade.
KEY_DIGEST_HEX = "6f9aa08f615a2965f316b3f5b03b0d07"
VECTORS_HEX = ["2b5f5bee823e7b0d1e4f90ac8fb826ca", "57d16f04b003707a82e04ee8d4d7a65a"]
PLATFORM_VECTORS_HEX = [
    "349e3cfb93df4630c23c89664209bb9c",
    "c909749830e8f6a67e4a221922a2f719",
    "d2074b182ce57fe4eeea0fef1c119442",
]


def test_fixed_vectors() -> None:
    assert key_digest(KEY).hex() == KEY_DIGEST_HEX
    assert [h.hex() for h in block_hashes(KEY, list(range(40)))] == VECTORS_HEX


def test_fixed_vectors_follow_the_documented_construction() -> None:
    def blk(prev: bytes, tokens: range) -> bytes:
        raw = b"".join(t.to_bytes(4, "little") for t in tokens)
        return hashlib.blake2b(prev + raw, digest_size=16, person=b"kvfleet-blk-v1").digest()

    h0 = blk(bytes.fromhex(KEY_DIGEST_HEX), range(0, 16))
    h1 = blk(h0, range(16, 32))
    assert [h0.hex(), h1.hex()] == VECTORS_HEX


def test_platform_scoped_vectors() -> None:
    hashes = block_hashes(KEY, list(range(48)), platform_blocks=1)
    assert [h.hex() for h in hashes] == PLATFORM_VECTORS_HEX
    # The platform block is the same for every tenant; the tenant blocks are not.
    other = block_hashes(KEY._replace(tenant_id="tenant-b"), list(range(48)), platform_blocks=1)
    assert other[0] == hashes[0] and other[1] != hashes[1] and other[2] != hashes[2]
    assert hashes[0] == block_hashes(platform_key(KEY), list(range(16)))[0]


def test_hashes_are_the_same_in_another_process_with_another_hash_seed() -> None:
    code = (
        "from tests.runtime.cache.test_keys import KEY;"
        "from kvfleet_runtime.cache import block_hashes;"
        "print(','.join(h.hex() for h in block_hashes(KEY, list(range(40)))))"
    )
    for seed in ("0", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            cwd=str(__import__("pathlib").Path(__file__).resolve().parents[3]),
        ).stdout.strip()
        assert out.split(",") == VECTORS_HEX


@pytest.mark.parametrize(
    ("num_tokens", "num_blocks"), [(0, 0), (15, 0), (16, 1), (1507, 94), (1504, 94), (2000, 125)]
)
def test_only_full_blocks_are_hashed(num_tokens: int, num_blocks: int) -> None:
    assert len(block_hashes(KEY, list(range(num_tokens)))) == num_blocks


def test_chaining_a_block_depends_on_every_block_before_it() -> None:
    a = list(range(64))
    b = a.copy()
    b[3] = 999  # differs in block 0 only
    ha, hb = block_hashes(KEY, a), block_hashes(KEY, b)
    assert all(x != y for x, y in zip(ha, hb, strict=True))  # blocks 1..3 equal, hashes not
    c = a.copy()
    c[40] = 999  # differs in block 2
    hc = block_hashes(KEY, c)
    assert hc[:2] == ha[:2] and hc[2] != ha[2] and hc[3] != ha[3]


@pytest.mark.parametrize(
    "field",
    ["tenant_id", "model_id", "weights_digest", "kv_dtype", "rope_config_hash", "attn_impl_id"],
)
def test_every_key_field_changes_every_hash(field: str) -> None:
    value = "sha256:" + "f" * 64 if field == "weights_digest" else "changed"
    other = KEY._replace(**{field: value})
    tokens = list(range(48))
    assert not set(block_hashes(KEY, tokens)) & set(block_hashes(other, tokens))


def test_key_encoding_is_injective_across_field_boundaries() -> None:
    a = KEY._replace(model_id="ab", kv_dtype="c")
    b = KEY._replace(model_id="a", kv_dtype="bc")
    assert key_digest(a) != key_digest(b)


@pytest.mark.parametrize("digest", ["latest", "v2", "sha256:abc", "sha256:" + "A" * 64, ""])
def test_weights_digest_must_be_a_content_digest(digest: str) -> None:
    with pytest.raises(ValueError, match="weights_digest"):
        block_hashes(make_key(digest=digest), list(range(16)))


@pytest.mark.parametrize("tokens", [[-1] * 16, [2**32] * 16, [1.5] * 16])
def test_bad_token_ids_are_rejected_with_the_value(tokens: list[object]) -> None:
    with pytest.raises(ValueError, match="token ids"):
        block_hashes(KEY, tokens)  # type: ignore[arg-type]


def test_empty_key_field_is_rejected() -> None:
    with pytest.raises(ValueError, match="model_id"):
        block_hashes(KEY._replace(model_id=""), list(range(16)))


def test_hashing_is_lazy() -> None:
    it = iter_block_hashes(KEY, list(range(BLOCK_SIZE * 3)))
    assert next(it).hex() == VECTORS_HEX[0]


# -- the chain memo ---------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(
        st.lists(st.integers(0, 3), min_size=0, max_size=6 * BLOCK_SIZE), min_size=1, max_size=8
    ),
    tenants=st.lists(st.sampled_from(["tenant-a", "tenant-b"]), min_size=8, max_size=8),
    platform=st.lists(st.booleans(), min_size=8, max_size=8),
    remember=st.lists(st.booleans(), min_size=8, max_size=8),
    max_entries=st.integers(2, 12),
)
def test_a_memo_returns_exactly_what_hashing_returns(
    prompts: list[list[int]],
    tenants: list[str],
    platform: list[bool],
    remember: list[bool],
    max_entries: int,
) -> None:
    # Tiny alphabets and memos: steps repeat across prompts and tenants and the memo rotates
    # its generations all the time, so a wrong hit (another tenant, another position) shows.
    memo = ChainMemo(max_entries)
    for _ in range(2):
        for tokens, tenant, scoped, add in zip(prompts, tenants, platform, remember, strict=False):
            key = KEY._replace(tenant_id=tenant)
            blocks = 1 if scoped and len(tokens) >= BLOCK_SIZE else 0
            expected = block_hashes(key, tokens, platform_blocks=blocks)
            got = list(
                iter_block_hashes(key, tokens, platform_blocks=blocks, memo=memo, remember=add)
            )
            assert got == expected
            assert len(memo) <= max_entries


def test_a_memo_hashes_a_hot_prefix_once_and_counts_only_the_steps_taken() -> None:
    memo = ChainMemo(1024)
    tokens = list(range(10 * BLOCK_SIZE))

    def chain(remember: bool) -> list[bytes]:
        return list(iter_block_hashes(KEY, tokens, memo=memo, remember=remember))

    assert chain(remember=False) == block_hashes(KEY, tokens)  # a store or a peer: reads only
    assert (memo.num_hits, memo.num_misses, len(memo)) == (0, 10, 0)
    assert chain(remember=True) == block_hashes(KEY, tokens)  # a lookup: remembers
    assert (memo.num_hits, memo.num_misses, len(memo)) == (0, 20, 10)
    assert chain(remember=False) == block_hashes(KEY, tokens)
    assert (memo.num_hits, memo.num_misses) == (10, 20)
    lazy = iter_block_hashes(KEY, tokens, memo=memo, remember=True)
    next(lazy), next(lazy)
    del lazy  # a lookup stops at its first miss and drops the chain
    assert (memo.num_hits, memo.num_misses) == (12, 20)


def test_a_memo_is_bounded_and_keeps_what_was_used_last() -> None:
    memo = ChainMemo(8)  # two generations of 4 steps

    def look(tokens: list[int]) -> None:
        list(iter_block_hashes(KEY, tokens, memo=memo, remember=True))

    hot = list(range(2 * BLOCK_SIZE))
    look(hot)
    for n in range(6):  # other prefixes looked up between uses of the hot one
        look([1000 + n] * BLOCK_SIZE)
        hits = memo.num_hits
        look(hot)
        assert memo.num_hits == hits + 2
        assert len(memo) <= 8
    cold = memo.num_misses
    look([1000] * BLOCK_SIZE)  # long gone
    assert memo.num_misses == cold + 1


@pytest.mark.parametrize("bad", [0, 1, -4, 2.5])
def test_a_memo_needs_room_for_two_steps(bad: object) -> None:
    with pytest.raises(ValueError, match="max_entries"):
        ChainMemo(bad)  # type: ignore[arg-type]


def test_a_memo_shared_by_threads_never_returns_a_wrong_digest() -> None:
    # No lock: threads racing on a 6-step memo rotate its generations under each other.
    memo = ChainMemo(6)
    prompts = [[(p * 7 + t) % 5 for t in range(4 * BLOCK_SIZE)] for p in range(6)]
    expected = [block_hashes(KEY, tokens) for tokens in prompts]
    wrong: list[int] = []

    def worker(offset: int) -> None:
        for i in range(300):
            p = (i + offset) % len(prompts)
            got = list(iter_block_hashes(KEY, prompts[p], memo=memo, remember=i % 3 != 0))
            if got != expected[p]:
                wrong.append(p)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads every few bytecodes, inside the chain loop
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    finally:
        sys.setswitchinterval(interval)
    assert not any(thread.is_alive() for thread in threads)
    assert wrong == []
