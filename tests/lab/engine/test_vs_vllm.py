"""The engine comparison's arithmetic: medians per side of interleaved runs, kvfleet / vLLM."""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet_lab.engine.vs_vllm import compare, read_result, serve_command


def result(ttft: float, tpot: float, tok_s: float) -> dict[str, Any]:
    """The keys `vllm bench serve --save-result` writes (and some it writes that we ignore)."""
    return {"median_ttft_ms": ttft, "p99_ttft_ms": 3 * ttft, "median_tpot_ms": tpot,
            "p99_tpot_ms": 2 * tpot, "output_throughput": tok_s, "completed": 48}


def test_ratios_are_of_the_medians_per_side() -> None:
    ours = [read_result(result(t, p, s)) for t, p, s in ((30, 4, 90), (10, 2, 100), (20, 3, 80))]
    theirs = [read_result(result(t, p, s)) for t, p, s in ((10, 1, 200), (40, 9, 10),
                                                            (20, 2, 100))]
    c = compare("tiny-llama-bf16", 4, ours, theirs)
    assert (c.kvfleet.ttft_p50_ms, c.vllm.ttft_p50_ms) == (20, 20)
    assert c.tpot_p50_ratio == 3 / 2 and c.tpot_p99_ratio == 6 / 4
    assert c.ttft_p99_ratio == 60 / 60 and c.throughput_ratio == 90 / 100
    d = c.to_dict()
    assert {"checkpoint": "tiny-llama-bf16", "concurrency": 4, "runs": 3}.items() <= d.items()
    assert d["tpot_p50_ratio"] == 1.5 and d["throughput_ratio"] == 0.9


def test_unpaired_runs_and_empty_results_are_refused() -> None:
    one = read_result(result(1, 1, 1))
    with pytest.raises(ValueError, match="pairs"):
        compare("m", 1, [one, one], [one])
    with pytest.raises(ValueError, match="pairs"):
        compare("m", 1, [], [])
    with pytest.raises(ValueError, match="'output_throughput' is 0"):
        read_result(result(1, 1, 0))
    with pytest.raises(ValueError, match="'median_tpot_ms' is None"):
        read_result({**result(1, 1, 1), "median_tpot_ms": None})


def test_both_sides_get_the_same_client_arguments(tmp_path: Any) -> None:
    kw = dict(model="m", tokenizer="/ckpt", concurrency=4, num_prompts=48,
              extra=["--dataset-name", "prefix_repetition"], result_dir=tmp_path,
              result_name="r.json")
    a = serve_command("vllm", base_url="http://127.0.0.1:1", **kw)  # type: ignore[arg-type]
    b = serve_command("vllm", base_url="http://127.0.0.1:2", **kw)  # type: ignore[arg-type]
    assert [x for x in a if "127.0.0.1" not in x] == [x for x in b if "127.0.0.1" not in x]
    assert a[a.index("--max-concurrency") + 1] == "4" and a[-2:] == ["--dataset-name",
                                                                     "prefix_repetition"]
