"""Stop strings on streamed text: what is sent is exactly the text before the first stop."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfleet_runtime.api import StopMatcher


def run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    m = StopMatcher(stops)
    out = [m.push(p) for p in pieces]
    out.append(m.flush())
    return out, m.stopped


@pytest.mark.parametrize(
    ("stops", "pieces", "sent", "stopped"),
    [
        ([], ["ab", "c"], ["ab", "c", ""], False),
        (["\n"], ["ab", "c\nd", "e"], ["ab", "c", "", ""], True),
        # "EN" might start "END": held back until the next piece decides.
        (["END"], ["abE", "N", "D!"], ["ab", "", "", ""], True),
        (["END"], ["abE", "N", "x"], ["ab", "", "ENx", ""], False),
        (["END"], ["abEN"], ["ab", "EN"], False),  # generation ended: the held tail is sent
        (["xyz", "y"], ["axy"], ["ax", ""], True),  # the earliest stop wins
        (["ab", "b"], ["ab"], ["", ""], True),
    ],
)
def test_stop_matcher_holds_back_only_what_could_start_a_stop(
    stops: list[str], pieces: list[str], sent: list[str], stopped: bool
) -> None:
    assert run(stops, pieces) == (sent, stopped)


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher(["a", ""])


@given(
    stops=st.lists(st.text("abc", min_size=1, max_size=3), max_size=3),
    pieces=st.lists(st.text("abc", max_size=4), max_size=8),
)
def test_sent_text_is_the_text_before_the_first_stop(stops: list[str], pieces: list[str]) -> None:
    out, stopped = run(stops, pieces)
    text = "".join(pieces)
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    expected = text[: min(cuts)] if cuts else text
    assert "".join(out) == expected
    assert stopped == bool(cuts)
