"""`kvfleet bench nvme` on a real directory: the figures' shape, the verdict arithmetic and a
clear error for a path that cannot host the store. No timing is asserted (a benchmark prints
figures; it does not pass or fail on them)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvfleet_lab.cli import kvfleet_app
from kvfleet_lab.nvme.bench import reference_block_bytes, run_nvme_bench
from kvfleet_runtime.nvme import STORE_FILENAME

app = kvfleet_app()


def test_reference_block_is_5_mib() -> None:
    assert reference_block_bytes() == 16 * 327_680 == 5 << 20


def test_bench_measures_every_level_and_cleans_up(tmp_path: Path) -> None:
    report = run_nvme_bench(tmp_path, concurrency=(1, 2), size_bytes=64 << 10,
                            run_blocks=2, block_bytes=8192, reps=2)
    data = report.to_dict()
    assert [r["concurrency"] for r in data["reads"]] == [1, 2]
    assert set(data["reads"][0]) == {"concurrency", "store_read_gb_s", "raw_read_gb_s", "ratio",
                                     "store_read_reps_gb_s", "raw_read_reps_gb_s"}
    assert all(r["store_read_gb_s"] > 0 and r["raw_read_gb_s"] > 0 for r in data["reads"])
    for figures in data["reads"] + data["writes"]:
        kind = "read" if "store_read_gb_s" in figures else "write"
        store, raw = figures[f"store_{kind}_reps_gb_s"], figures[f"raw_{kind}_reps_gb_s"]
        assert len(store) == len(raw) == 2  # one pass per side and rep
        # Medians per side, and the ratio is the ratio of the medians.
        assert figures[f"store_{kind}_gb_s"] == statistics.median(store)
        assert figures[f"raw_{kind}_gb_s"] == statistics.median(raw)
        assert figures["ratio"] == statistics.median(store) / statistics.median(raw)
    assert data["bytes_per_level"] == 64 << 10  # 4 runs x 2 blocks x 8 KiB
    # The verdict is the break-even arithmetic of the reference model at TP4 (docs/design.md §1).
    fp16, fp8 = data["verdicts"]
    assert (fp16["kv_dtype"], round(fp16["break_even_gb_s"], 2)) == ("fp16", 9.26)
    assert (fp8["kv_dtype"], round(fp8["break_even_gb_s"], 2)) == ("fp8", 4.63)
    assert fp16["margin"] == pytest.approx(fp16["measured_gb_s"] / fp16["break_even_gb_s"])
    assert list(tmp_path.iterdir()) == []  # neither the store file nor the raw file is left


def test_buffered_mode_measures_the_device_not_the_page_cache(tmp_path: Path) -> None:
    report = run_nvme_bench(tmp_path, concurrency=(2,), size_bytes=64 << 10, run_blocks=2,
                            block_bytes=8192, reps=3, direct=False)
    data = report.to_dict()
    assert data["direct_io"] is False and data["page_cache"] == "dropped before each read"
    assert len(data["reads"][0]["store_read_reps_gb_s"]) == 3
    assert list(tmp_path.iterdir()) == []


def test_cli_json_and_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["bench", "nvme", "--path", str(tmp_path), "--size-mib", "20",
                                 "--run-blocks", "1", "--reps", "1", "--concurrency", "1,4",
                                 "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert [r["concurrency"] for r in data["reads"]] == [1, 4]
    assert not (tmp_path / STORE_FILENAME).exists()
    # A folder that does not exist yet is made (as --out is); one that cannot be is bad input.
    made = runner.invoke(app, ["bench", "nvme", "--path", str(tmp_path / "new" / "d"),
                               "--size-mib", "22", "--run-blocks", "1", "--reps", "1",
                               "--concurrency", "1"])
    assert made.exit_code == 0, made.output
    assert "20 MiB per level (--size-mib 22 rounded down to whole I/Os)" in " ".join(
        made.output.split())
    (tmp_path / "file").write_text("x")
    missing = runner.invoke(app, ["bench", "nvme", "--path", str(tmp_path / "file" / "d")])
    assert missing.exit_code == 2 and "cannot create the folder" in missing.output
    assert "Traceback" not in missing.output
    bad = runner.invoke(app, ["bench", "nvme", "--path", str(tmp_path), "--concurrency", "a"])
    assert bad.exit_code != 0 and "comma-separated integers, got 'a'" in bad.output
