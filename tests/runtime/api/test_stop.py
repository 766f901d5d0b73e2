"""Stop strings on streamed text: what is sent is exactly the text before the first stop."""

from __future__ import annotations

import pytest
from hypothesis import example, given
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
@example(stops=["bac", "a"], pieces=["bb", "ba", "cb"])  # "a" completes first, "bac" starts first
def test_sent_text_is_the_text_before_the_first_stop(stops: list[str], pieces: list[str]) -> None:
    # Generation stops at the first piece that completes a stop string (as vLLM's and
    # OpenAI's servers do), cut where the earliest stop string found by then starts: a
    # longer stop string that starts earlier but would end later never completes.
    out, stopped = run(stops, pieces)
    text, expected, cut = "", None, False
    for piece in pieces:
        text += piece
        cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
        if cuts:
            expected, cut = text[: min(cuts)], True
            break
    assert "".join(out) == (text if expected is None else expected)
    assert stopped == cut
