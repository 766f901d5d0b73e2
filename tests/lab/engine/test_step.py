"""The decode-step timer runs a real engine and reports each concurrency's figures."""

from __future__ import annotations

import pytest

from kvfleet_lab.engine.step import main


def test_step_timer_reports_every_concurrency(capsys: pytest.CaptureFixture[str]) -> None:
    out = main(["--preset", "tiny", "--concurrency", "1,3", "--new-tokens", "5",
                "--prompt-tokens", "20", "--profile"])
    assert set(out) == {"1", "3"}
    for figures in out.values():
        # 5 tokens: the prefill step samples the first and decodes the second, 3 steps decode
        assert figures["steps"] == 3 and figures["step_ms_p50"] > 0 and figures["tok_s"] > 0
    printed = capsys.readouterr().out
    assert "RESULT" in printed and "decode_step" in printed  # the profile names the forward
