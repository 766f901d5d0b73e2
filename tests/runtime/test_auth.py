"""The tenant assertion and the replay cache (pure: an injected clock, no servers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet_runtime.auth import (
    MAX_ASSERTION_TTL_S,
    MAX_ASSERTIONS,
    MAX_CLOCK_SKEW_S,
    AssertionRefused,
    ReplayCache,
    TenantAssertion,
    bearer_matches,
    read_secret,
    sign_assertion,
    verify_assertion,
)
from tests.support import FakeClock

SECRET = b"router-secret-for-tests"
NOW = 1_800_000_000.0


def sign(tenant: str = "acme", *, secret: bytes = SECRET, audience: str = "r0",
         method: str = "POST", path: str = "/v1/completions", now_s: float = NOW,
         ttl_s: float = 10.0) -> str:
    return sign_assertion(secret, tenant, audience=audience, method=method, path=path,
                          now_s=now_s, ttl_s=ttl_s)


def verify(value: str | None, tenant: str = "acme", *, method: str = "POST",
           path: str = "/v1/completions", own_name: str | None = "r0", now_s: float = NOW,
           replays: ReplayCache | None = None) -> TenantAssertion | AssertionRefused:
    return verify_assertion(SECRET, value, tenant, method=method, path=path, own_name=own_name,
                            replays=ReplayCache(16, FakeClock(now_s)) if replays is None
                            else replays,
                            now_s=now_s)


def reason(result: TenantAssertion | AssertionRefused) -> str:
    return result.reason if isinstance(result, AssertionRefused) else "ok"


def test_a_fresh_assertion_verifies_once() -> None:
    replays = ReplayCache(16, FakeClock(NOW))
    value = sign()
    first = verify(value, replays=replays)
    assert isinstance(first, TenantAssertion)
    assert (first.tenant, first.audience, first.expires_at_s) == ("acme", "r0", NOW + 10.0)
    again = verify(value, replays=replays)
    assert isinstance(again, AssertionRefused)
    assert (again.reason, again.status) == ("replayed", 401)
    assert len(replays) == 1


@pytest.mark.parametrize(
    ("value", "kwargs", "expected", "status"),
    [
        (None, {}, "missing", 401),
        ("", {}, "missing", 401),
        ("v1.garbage", {}, "malformed", 401),
        ("v2" + sign()[2:], {}, "malformed", 401),
        (sign(secret=b"another-secret"), {}, "forged", 401),
        (sign(tenant="globex"), {}, "forged", 401),  # a real assertion, for another tenant
        (sign(), {"tenant": "globex"}, "forged", 401),
        (sign(method="GET"), {}, "forged", 401),  # another request: method and path are signed
        (sign(path="/v1/chat/completions"), {}, "forged", 401),
        (sign(), {"path": "/cache/stats", "method": "GET"}, "forged", 401),
        (sign(now_s=NOW - 10.0 - MAX_CLOCK_SKEW_S - 0.01), {}, "expired", 401),
        (sign(now_s=NOW - 10.0 - MAX_CLOCK_SKEW_S + 0.01), {}, "ok", 200),  # within the skew
        (sign(now_s=NOW + 2 * MAX_ASSERTION_TTL_S), {}, "too_long", 401),
        (sign(audience="r1"), {}, "audience", 403),  # minted for another replica
        (sign(audience="r1"), {"own_name": None}, "ok", 200),  # a replica without a name
    ],
)
def test_refusals_name_their_reason(value: str | None, kwargs: dict[str, object],
                                    expected: str, status: int) -> None:
    result = verify(value, **kwargs)  # type: ignore[arg-type]
    assert reason(result) == expected
    if isinstance(result, AssertionRefused):
        assert result.status == status and result.message


def test_a_tampered_field_fails_the_mac() -> None:
    version, expires, nonce, mac, audience = sign().split(".", 4)
    later = f"{version}.{int(expires) + 60_000}.{nonce}.{mac}.{audience}"
    other_nonce = f"{version}.{expires}.{'0' * 32}.{mac}.{audience}"
    retargeted = f"{version}.{expires}.{nonce}.{mac}.r1"
    assert [reason(verify(v, own_name=None)) for v in (later, other_nonce, retargeted)] == [
        "forged", "forged", "forged"]


def test_a_list_is_checked_by_the_entry_for_this_replica_once_at_each() -> None:
    """The EPP's header: one assertion per replica Envoy may try; each replica takes its own."""
    listed = ",".join(sign(audience=name) for name in ("r1", "r0", "r2"))
    replays = {name: ReplayCache(16, FakeClock(NOW)) for name in ("r0", "r1", "r2", "r3")}
    ok = {name: verify(listed, own_name=name, replays=replays[name]) for name in replays}
    assert {name: reason(r) for name, r in ok.items()} == {
        "r0": "ok", "r1": "ok", "r2": "ok", "r3": "audience"}
    nonces = {r.nonce for r in ok.values() if isinstance(r, TenantAssertion)}
    assert len(nonces) == 3  # each its own nonce: a replay at one is no use at another
    assert reason(verify(listed, own_name="r0", replays=replays["r0"])) == "replayed"
    assert reason(verify(listed, own_name="r1", tenant="globex")) == "forged"


@pytest.mark.parametrize("value", [
    ",".join([sign()] * (MAX_ASSERTIONS + 1)),  # too many entries: none is parsed
    sign() + ",",
    sign() + ",v1.garbage",  # one bad entry spoils the list
])
def test_a_list_longer_than_the_cap_or_with_a_bad_entry_is_malformed(value: str) -> None:
    assert reason(verify(value)) == "malformed"


def test_a_replica_name_with_a_comma_cannot_be_an_audience() -> None:
    with pytest.raises(ValueError, match="cannot hold ','"):
        sign(audience="r0,r1")


def test_a_forged_assertion_is_not_remembered() -> None:
    replays = ReplayCache(1, FakeClock(NOW))
    assert reason(verify(sign(secret=b"x"), replays=replays)) == "forged"
    assert len(replays) == 0
    assert reason(verify(sign(), replays=replays)) == "ok"


def test_the_replay_cache_is_bounded_and_forgets_expired_nonces() -> None:
    clock = FakeClock(NOW)
    cache = ReplayCache(2, clock)
    assert [cache.admit("a", NOW + 1), cache.admit("b", NOW + 5), cache.admit("a", NOW + 1)] == [
        True, True, False]
    assert cache.admit("c", NOW + 5) is None  # full of live nonces: no room, never forget one
    clock.now_s = NOW + 2  # "a" expired: its assertion is refused by the expiry check anyway
    assert cache.admit("c", NOW + 5) is True
    assert len(cache) == 2
    assert cache.admit("b", NOW + 5) is False
    with pytest.raises(ValueError, match="max_entries must be >= 1, got 0"):
        ReplayCache(0, clock)


def test_a_full_replay_cache_refuses_with_503() -> None:
    replays = ReplayCache(1, FakeClock(NOW))
    assert reason(verify(sign(), replays=replays)) == "ok"
    busy = verify(sign(), replays=replays)
    assert isinstance(busy, AssertionRefused) and (busy.reason, busy.status) == ("busy", 503)


def test_sign_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="router secret is empty"):
        sign(secret=b"")
    with pytest.raises(ValueError, match="ttl_s must be in"):
        sign(ttl_s=MAX_ASSERTION_TTL_S + 1)


@pytest.mark.parametrize(
    ("header", "ok"),
    [("Bearer tok", True), ("bearer tok", True), ("Bearer  tok ", True), ("Bearer tok2", False),
     ("Basic tok", False), ("tok", False), ("", False), (None, False)],
)
def test_bearer_matches(header: str | None, ok: bool) -> None:
    assert bearer_matches(header, b"tok") is ok


def test_read_secret_from_env_file_and_default(tmp_path: Path) -> None:
    default = tmp_path / "mounted"
    assert read_secret({}, "S", "S_FILE", default) is None
    default.write_text("from-default\n")
    assert read_secret({}, "S", "S_FILE", default) == b"from-default"
    named = tmp_path / "named"
    named.write_text("  from-file \n")
    assert read_secret({"S_FILE": str(named)}, "S", "S_FILE", default) == b"from-file"
    assert read_secret({"S": "from-env", "S_FILE": str(named)}, "S", "S_FILE", default) == (
        b"from-env")
    with pytest.raises(ValueError, match=r"cannot read S_FILE=.*missing"):
        read_secret({"S_FILE": str(tmp_path / "missing")}, "S", "S_FILE", default)
