"""The engine comparison's arithmetic: medians per side of interleaved runs, kvfleet / vLLM."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from kvfleet_lab.engine.vs_vllm import (
    FirstTokens,
    compare,
    kvfleet_server,
    make_checkpoint,
    prefix_repetition_args,
    read_result,
    serve_command,
    vllm_server,
)


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


def test_first_tokens_ratio_is_kvfleet_hit_over_vllm_hit() -> None:
    f = FirstTokens(601, 5, kvfleet_miss_ms=80, kvfleet_hit_ms=20, vllm_miss_ms=40,
                    vllm_hit_ms=25)
    assert f.hit_ratio == 20 / 25 and f.to_dict()["miss_ratio"] == 2.0
    one = read_result(result(1, 1, 1))
    row = dataclasses.replace(compare("m", 4, [one], [one]), first_tokens=f)
    assert row.to_dict()["first_tokens"]["hit_ratio"] == 0.8
    assert compare("m", 4, [one], [one]).to_dict()["first_tokens"] is None


def test_both_servers_get_the_same_thread_count(tmp_path: Path) -> None:
    k = kvfleet_server(tmp_path / "ckpt", model="m", cpu_threads=3, log_dir=tmp_path, port=1)
    assert json.loads(Path(k.cmd[k.cmd.index("--config") + 1]).read_text())["cpu_threads"] == 3
    v = vllm_server("vllm", tmp_path / "ckpt", model="m", cpu_threads=3, log_dir=tmp_path,
                    port=2)
    assert v.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-2"  # three cores, one OMP thread each
    one = vllm_server("vllm", tmp_path, model="m", cpu_threads=1, log_dir=tmp_path, port=3)
    assert one.env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    args = prefix_repetition_args()
    assert args[args.index("--prefix-repetition-prefix-len") + 1] == "512"
    assert "--ignore-eos" in args  # random weights may sample EOS; both sides make 16 tokens


def test_a_made_checkpoint_loads_in_kvfleet_with_vllm_cpu_head_dim(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from kvfleet_runtime.model import load_checkpoint

    out = make_checkpoint(tmp_path / "tiny", "tiny-llama")
    loaded = load_checkpoint(out)
    tok = AutoTokenizer.from_pretrained(str(out))
    assert loaded.args.head_dim == 64 and loaded.args.vocab_size == len(tok)
    assert loaded.args.dtype == "bfloat16"
