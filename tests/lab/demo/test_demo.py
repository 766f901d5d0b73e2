"""`kvfleet demo` end to end with real processes (a router and 3 replicas on 127.0.0.1), and
its cleanup: on success and on Ctrl-C, no child survives."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.lab.demo.conftest import CLI

pytestmark = pytest.mark.slow


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains `text` (the demo's out folder is in every child's)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry.name))
    return pids


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may contain spaces; fields after its closing parenthesis are fixed.
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"


def test_quick_demo_end_to_end(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "out"
    result = subprocess.run(
        [*CLI, "demo", "--quick", "--model-dir", str(tiny_model_dir), "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    report = json.loads((out / "report.json").read_text())

    assert set(report) >= {"workload", "fleet", "runs", "hit_rate", "ttft_ms", "prefill",
                           "gpu_seconds_saved", "tiers", "routing", "timings_s", "command"}
    assert report["fleet"]["num_replicas"] == 3
    assert set(report["hit_rate"]["by_population"]) == {"system_prompt", "rag", "conversation"}
    for run in ("baseline", "cached"):
        assert report["runs"][run]["num_ok"] == report["workload"]["num_requests"] == 36
        assert report["runs"][run]["errors"] == {}
        assert report["ttft_ms"][run]["p50"] > 0
        assert report["ttft_ms"][run]["p99"] >= report["ttft_ms"][run]["p50"]
    # The cache-off run hits nothing; the cached run really hits and prefills less.
    assert report["runs"]["baseline"]["cached_tokens"] == 0
    assert report["hit_rate"]["token_weighted"] > 0.2
    prefill = report["prefill"]
    assert prefill["baseline_tokens"] == report["workload"]["prompt_tokens"]
    assert prefill["cached_tokens"] < prefill["baseline_tokens"]
    assert prefill["tokens_saved"] == report["runs"]["cached"]["cached_tokens"] > 0
    assert report["gpu_seconds_saved"]["value"] == pytest.approx(
        prefill["tokens_saved"] * 141.5e-6, rel=1e-3)
    tiers = report["tiers"]["tokens"]
    assert set(tiers) == {"t0", "t1", "t2", "miss"}
    assert sum(tiers.values()) == prefill["baseline_tokens"]
    # No Redis: the replicas' hint index is the peer probe, and what they fetched over T2 is
    # counted on the replicas themselves (nonzero only when a tenant lands off its first home).
    assert report["fleet"]["hint_index"].startswith("peer-probe")
    t2 = report["fleet"]["t2_measured"]
    assert set(t2) == {"fetches_ok", "tokens_fetched", "bytes_fetched", "outcomes"}
    assert t2["fetches_ok"] >= 0 and (t2["tokens_fetched"] > 0) == (t2["fetches_ok"] > 0)
    assert "refused" not in t2["outcomes"] and "disabled" not in t2["outcomes"]
    assert tiers["miss"] == prefill["cached_tokens"]
    assert 0.0 <= report["routing"]["spill_rate"] <= 1.0
    assert sum(report["routing"]["decisions"].values()) == 36

    for name in ("hit_rate_over_time.png", "ttft_distribution.png", "tier_mix.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "token-weighted hit rate" in result.stdout
    assert str(out / "report.json") in result.stdout
    assert processes_mentioning(str(out)) == []


def test_ctrl_c_mid_run_leaves_no_child(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "out"
    # Enough work that the run is surely still going when the signal comes (~25 s of runs).
    # Ctrl-C as at a terminal: the child must not inherit SIGINT ignored, as it does when this
    # run is a background job of a non-interactive shell (Python then keeps it ignored and the
    # demo ran to its end, exit 0). A handler, unlike SIG_IGN, is not inherited across exec.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [*CLI, "demo", "--quick", "--requests", "4000", "--model-dir", str(tiny_model_dir),
             "--out", str(out)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 300
        for line in proc.stdout:
            if line.startswith("fleet: router"):
                break
            assert time.monotonic() < deadline, "the fleet did not come up"
        else:
            pytest.fail("the demo ended before its fleet was up")
        children = children_of(proc.pid)
        assert len(children) == 4, children  # 3 replicas + the router
        time.sleep(3.0)  # mid-run: requests in flight
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    assert proc.stderr is not None
    stderr = proc.stderr.read()
    assert "Traceback" not in stderr
    assert "interrupted" in stderr
    assert [pid for pid in children if alive(pid)] == []
    assert processes_mentioning(str(out)) == []


def test_sigterm_also_cleans_up(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [*CLI, "demo", "--quick", "--model-dir", str(tiny_model_dir), "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("fleet: starting"):
                break
        time.sleep(1.0)  # while the replicas start
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    assert processes_mentioning(str(out)) == []
