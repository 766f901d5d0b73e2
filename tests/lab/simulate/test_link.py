"""The shared link: processor sharing with exact completion times (R6's arithmetic)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfleet_lab.simulate import SharedLink, fleet_profile, shared_fetch


def drain(link: SharedLink) -> dict[int, float]:
    done: dict[int, float] = {}
    while (t := link.next_done_s()) is not None:
        for fetch_id in link.finish(t):
            done[fetch_id] = t
    return done


def test_one_fetch_takes_bytes_over_bandwidth() -> None:
    link = SharedLink(100.0)
    link.start(2.0, 7, 50.0)
    assert drain(link) == {7: pytest.approx(2.5)}


def test_eight_concurrent_fetches_each_get_an_eighth() -> None:
    link = SharedLink(7e9)
    for fetch_id in range(8):
        link.start(0.0, fetch_id, 7e9)
    done = drain(link)
    assert sorted(done) == list(range(8))
    assert all(t == pytest.approx(8.0) for t in done.values())


def test_a_late_fetch_shares_then_runs_alone() -> None:
    link = SharedLink(100.0)
    link.start(0.0, 1, 100.0)  # alone for 0.5 s: 50 B; then 50 B/s each
    link.start(0.5, 2, 100.0)
    assert drain(link) == {1: pytest.approx(1.5), 2: pytest.approx(2.0)}


def test_epoch_changes_whenever_the_next_completion_moves() -> None:
    link = SharedLink(10.0)
    link.start(0.0, 1, 10.0)
    first = link.epoch
    link.start(0.0, 2, 10.0)
    assert link.epoch != first


@given(
    st.lists(
        st.tuples(st.floats(0, 100), st.floats(1, 1e9)),
        min_size=1,
        max_size=20,
    )
)
def test_every_fetch_finishes_no_earlier_than_alone_and_all_bytes_are_served(
    fetches: list[tuple[float, float]],
) -> None:
    bandwidth = 1e6
    link = SharedLink(bandwidth)
    done: dict[int, float] = {}
    events = sorted((start, i, size) for i, (start, size) in enumerate(fetches))
    for start, i, size in events:
        while (t := link.next_done_s()) is not None and t <= start:
            for fetch_id in link.finish(t):
                done[fetch_id] = t
        link.start(start, i, size)
    done.update(drain(link))
    assert sorted(done) == list(range(len(fetches)))
    for i, (start, size) in enumerate(fetches):
        assert done[i] >= start + size / bandwidth * (1 - 1e-9)
    # Work conservation: the link never idles with bytes pending, so the last fetch ends when
    # any work-conserving discipline (FIFO, say) would end it.
    makespan = 0.0
    for start, _, size in events:
        makespan = max(makespan, start) + size / bandwidth
    assert max(done.values()) == pytest.approx(makespan, rel=1e-9)


def test_r6_nvme_shared_by_eight_fetches_is_about_0_9_gb_s() -> None:
    result = shared_fetch(fleet_profile(), prefix_tokens=2000, num_concurrent=8)
    assert result.effective_bytes_per_s == pytest.approx(7e9 / 8)
    assert round(result.effective_bytes_per_s / 1e9, 1) == 0.9
    # ten times below the TP4 break-even of 9.26 GB/s
    assert result.break_even_bytes_per_s / result.effective_bytes_per_s == pytest.approx(
        10.6, abs=0.1
    )
