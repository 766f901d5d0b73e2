"""Every supported architecture and rope variant against transformers, the oracle.

Each case builds a tiny random checkpoint with transformers itself (`from_config`, weights drawn
large enough that a wrong rope or a dropped window changes the greedy tokens, then
`save_pretrained` with safetensors; no hub). kvfleet loads the folder and must give float32 logits
within 1e-4 of transformers' forward on the same ids, the same 32 greedy tokens as
`generate`, and read the transformers-4 style config (`rope_theta` / `rope_scaling`, written by
hand from the same weights) to the same model. Then the cache: a hit from T0, from T1 and from a
peer over T2 gives the same greedy tokens as the miss.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from aiohttp import web

from kvfleet_runtime.cache import CacheTuning, KVLayout, PrefixCache
from kvfleet_runtime.engine import (
    CacheKeyFields,
    Engine,
    EngineConfig,
    GenerationRequest,
    SamplingParams,
)
from kvfleet_runtime.fleet import (
    CacheBlockSource,
    EmbeddedHintIndex,
    PeerFetcher,
    PeerTier,
    peer_routes,
)
from kvfleet_runtime.model import (
    LoadedModel,
    PackedLinear,
    PagedKV,
    checkpoint_args,
    load_checkpoint,
    onednn_packing_supported,
    weights_digest,
)
from tests.support import free_port

VOCAB = 300
PROMPT_LEN = 40
NEW_TOKENS = 32
CPU = torch.device("cpu")
EAGER = "eager"
"""transformers' eager arithmetic, which the oracle models run; a checkpoint that names no
attention loads as SDPA (`test_a_transformers_checkpoint_serves_sdpa_by_default`)."""
SECRET = b"oracle-peer-secret"

_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=VOCAB, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # The first rows: a transformers-5 config with rope_theta 500000, and Llama 3.1.
    "llama-theta500k": ("LlamaConfig", {"rope_parameters": {"rope_type": "default",
                                                            "rope_theta": 500000.0}}),
    "llama3.1-rope": ("LlamaConfig", {"max_position_embeddings": 512, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "llama-linear": ("LlamaConfig", {"rope_parameters": {"rope_type": "linear",
                                                         "rope_theta": 10000.0, "factor": 4.0}}),
    "llama-dynamic": ("LlamaConfig", {"max_position_embeddings": 512, "rope_parameters": {
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}}),
    "llama-yarn": ("LlamaConfig", {"max_position_embeddings": 512, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 128}}),
    "llama-yarn-mscale": ("LlamaConfig", {"max_position_embeddings": 512, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 128, "beta_fast": 16.0, "beta_slow": 2.0,
        "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False}}),
    "llama-bias-tied": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True,
                                        "tie_word_embeddings": True}),
    "mistral-window16": ("MistralConfig", {"sliding_window": 16}),
    "qwen2": ("Qwen2Config", {}),
    "qwen2.5-tied-window": ("Qwen2Config", {"tie_word_embeddings": True,
                                            "use_sliding_window": True, "sliding_window": 16,
                                            "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "qwen3-tied": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True,
                                   "rope_parameters": {"rope_type": "default",
                                                       "rope_theta": 1000000.0}}),
}


def make_hf_model(config_cls: str, extra: dict[str, Any], seed: int = 0) -> Any:
    config = getattr(transformers, config_cls)(**{**_TINY, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith("bias"):
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
            else:
                fan_in = 1 if "embed_tokens" in name else param.shape[-1]
                param.copy_(torch.randn(param.shape, generator=gen) / fan_in**0.5)
    return model.eval()


def to_transformers4_style(src: Path, dst: Path) -> None:
    """The same weights with a config as transformers 4 wrote it: rope_theta and rope_scaling."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            os.link(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    params = dict(config.pop("rope_parameters"))
    config["rope_theta"] = params.pop("rope_theta")
    kind = params.pop("rope_type")
    if kind != "default":
        # Llama 3.1's own config says "rope_type"; older ones said "type".
        config["rope_scaling"] = {("rope_type" if kind == "llama3" else "type"): kind, **params}
    config.pop("dtype", None)
    config["torch_dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(config))


class Case:
    def __init__(self, name: str, root: Path) -> None:
        config_cls, extra = CASES[name]
        self.hf = make_hf_model(config_cls, extra)
        self.dir = root / name
        self.hf.save_pretrained(self.dir)
        self.dir4 = root / (name + "-t4")
        to_transformers4_style(self.dir, self.dir4)
        self.loaded = load_checkpoint(self.dir, device=CPU, attn_impl=EAGER)
        g = torch.Generator().manual_seed(len(name))
        self.prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=g).tolist()


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("oracle")
    return {name: Case(name, root) for name in CASES}


def kvfleet_greedy(loaded: LoadedModel, prompt: list[int], n: int
                   ) -> tuple[list[int], list[torch.Tensor]]:
    model = loaded.model
    kv = PagedKV.allocate(loaded.args, 16, device=CPU)
    table = kv.take(16)
    assert table is not None
    logits = [model.prefill(prompt, 0, table, kv)]
    out = [int(logits[-1].argmax())]
    for step in range(1, n):
        logits.append(model.decode([out[-1]], [len(prompt) + step - 1], [table], kv)[0])
        out.append(int(logits[-1].argmax()))
    return out, logits


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_greedy_tokens_equal_transformers(cases: dict[str, Case], name: str) -> None:
    case = cases[name]
    ids = torch.tensor([case.prompt])
    with torch.no_grad():
        ref_logits = case.hf(ids).logits[0]  # [S, V]
        gen = case.hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                               output_logits=True, return_dict_in_generate=True)
    ref_tokens = gen.sequences[0, PROMPT_LEN:].tolist()
    tokens, logits = kvfleet_greedy(case.loaded, case.prompt, NEW_TOKENS)
    # the prompt's last position, and every generated step, within 1e-4
    assert (logits[0] - ref_logits[-1]).abs().max().item() <= 1e-4
    steps = torch.stack([row[0] for row in gen.logits])
    assert (torch.stack(logits) - steps).abs().max().item() <= 1e-4
    assert tokens == ref_tokens


@pytest.mark.parametrize("name", ["mistral-window16", "qwen2.5-tied-window", "qwen3"])
def test_sdpa_attention_equals_transformers_too(cases: dict[str, Case], name: str) -> None:
    case = cases[name]
    loaded = load_checkpoint(case.dir, device=CPU, attn_impl="sdpa")
    assert loaded.args.attn_impl_id() != case.loaded.args.attn_impl_id()
    ids = torch.tensor([case.prompt])
    with torch.no_grad():
        gen = case.hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                               output_logits=True, return_dict_in_generate=True)
    tokens, logits = kvfleet_greedy(loaded, case.prompt, NEW_TOKENS)
    steps = torch.stack([row[0] for row in gen.logits])
    assert (torch.stack(logits) - steps).abs().max().item() <= 1e-4
    assert tokens == gen.sequences[0, PROMPT_LEN:].tolist()


@pytest.mark.parametrize("name", list(CASES))
def test_transformers4_config_reads_as_the_same_model(cases: dict[str, Case], name: str) -> None:
    case = cases[name]
    args5, _ = checkpoint_args(case.dir)
    args4, _ = checkpoint_args(case.dir4)
    assert args4 == args5
    if name == "llama-theta500k":
        assert args5.rope_theta == 500000.0  # the first row
    loaded4 = load_checkpoint(case.dir4, device=CPU, attn_impl=EAGER)
    assert loaded4.weights_digest == case.loaded.weights_digest
    assert kvfleet_greedy(loaded4, case.prompt, 4)[0] == kvfleet_greedy(
        case.loaded, case.prompt, 4)[0]


def test_the_window_and_rope_variants_change_the_answer(cases: dict[str, Case]) -> None:
    """The cases are discriminative: served without its window or its rope scaling, the same
    weights give other greedy tokens (what kvfleet used to do silently)."""
    for name, field, plain in (("mistral-window16", "sliding_window", None),
                               ("llama3.1-rope", "rope_scaling", None),
                               ("llama-theta500k", "rope_theta", 10000.0)):
        case = cases[name]
        args = case.loaded.args
        setattr(args, field, plain)
        try:
            wrong = load_checkpoint_with(case.dir, args)
            assert kvfleet_greedy(wrong, case.prompt, NEW_TOKENS)[0] != kvfleet_greedy(
                case.loaded, case.prompt, NEW_TOKENS)[0], name
        finally:
            case.loaded = load_checkpoint(case.dir, device=CPU, attn_impl=EAGER)


def load_checkpoint_with(model_dir: Path, args: Any) -> LoadedModel:
    from kvfleet_runtime.model import Transformer

    loaded = load_checkpoint(model_dir, device=CPU, attn_impl=EAGER)
    model = Transformer(args)
    model.load_state_dict(loaded.model.state_dict(), strict=False)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return LoadedModel(model=model.eval(), args=args, weights_digest=loaded.weights_digest,
                       model_dir=model_dir)


def test_sharded_checkpoint_loads_from_its_index(cases: dict[str, Case], tmp_path: Path) -> None:
    case = cases["qwen2"]
    case.hf.save_pretrained(tmp_path, max_shard_size="100KB")
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    (tmp_path / "stray.safetensors").write_bytes(b"not in the index")  # never read
    loaded = load_checkpoint(tmp_path, device=CPU, attn_impl=EAGER)
    assert weights_digest(tmp_path) == loaded.weights_digest != case.loaded.weights_digest
    assert kvfleet_greedy(loaded, case.prompt, 8)[0] == kvfleet_greedy(
        case.loaded, case.prompt, 8)[0]


def test_bf16_checkpoint_is_served_in_bf16(cases: dict[str, Case], tmp_path: Path) -> None:
    case = cases["qwen3"]
    case.hf.to(torch.bfloat16).save_pretrained(tmp_path)
    case.hf.to(torch.float32)
    loaded = load_checkpoint(tmp_path, device=CPU, attn_impl=EAGER)
    assert loaded.args.dtype == "bfloat16"
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.args.kv_bytes_per_token == case.loaded.args.kv_bytes_per_token // 2
    assert PagedKV.allocate(loaded.args, 1, device=CPU).k.dtype == torch.bfloat16
    assert CacheKeyFields.for_model(loaded, "m").kv_dtype == "bfloat16"
    as_fp32 = load_checkpoint(tmp_path, device=CPU, attn_impl=EAGER, dtype="fp32")
    assert as_fp32.model.embed_tokens.weight.dtype == torch.float32
    assert as_fp32.weights_digest == loaded.weights_digest


# ---- the cache: T0, T1 and T2 hits give the miss's tokens, per architecture -------------------

def make_cache(loaded: LoadedModel, *, t0: int, t1: int) -> PrefixCache:
    a = loaded.args
    return PrefixCache(CacheTuning(num_t0_blocks=t0, num_t1_blocks=t1, admit_min_sightings=1),
                       KVLayout(a.n_layers, a.n_kv_heads, a.head_dim, dtype=a.dtype),
                       clock=time.monotonic, device="cpu")


async def generate(engine: Engine, prompt: list[int]) -> tuple[list[int], int]:
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    tokens, done = await engine.generate(GenerationRequest("acme", tuple(prompt), params))
    return tokens, done.cached_tokens


@pytest.mark.parametrize("name", ["llama3.1-rope", "mistral-window16", "qwen2.5-tied-window",
                                  "qwen3-tied", "llama-yarn"])
async def test_cache_hits_from_t0_t1_and_a_peer_equal_the_miss(
        cases: dict[str, Case], name: str) -> None:
    case = cases[name]
    loaded = case.loaded
    fields = CacheKeyFields.for_model(loaded, name)
    config = EngineConfig(num_kv_blocks=64)
    engines: list[Engine] = []

    async def engine(cache: PrefixCache | None) -> Engine:
        e = Engine(loaded.model, fields, cache=cache, config=config)
        await e.start()
        engines.append(e)
        return e

    runner: web.AppRunner | None = None
    try:
        miss, cached = await generate(await engine(None), case.prompt)
        assert cached == 0
        assert miss == kvfleet_greedy(loaded, case.prompt, NEW_TOKENS)[0]
        for t0, t1 in ((256, 0), (0, 256)):
            cache = make_cache(loaded, t0=t0, t1=t1)
            e = await engine(cache)
            await generate(e, case.prompt)
            await e.drain_stores()
            hit, cached = await generate(e, case.prompt)
            assert (cached, hit) == (32, miss), (t0, t1)

        # T2: peer a holds the prefix; b fetches it over loopback HTTP, then serves from it.
        a_cache, b_cache = make_cache(loaded, t0=256, t1=0), make_cache(loaded, t0=256, t1=0)
        a = await engine(a_cache)
        await generate(a, case.prompt)
        await a.drain_stores()
        app = web.Application()
        app.add_routes(peer_routes(CacheBlockSource(a_cache), SECRET))
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        index = EmbeddedHintIndex()
        await index.register_host("a", f"http://127.0.0.1:{port}")
        key = fields.key("acme")
        await index.publish("a", a_cache.block_hashes(key, case.prompt))
        b = await engine(b_cache)
        b.lower_tiers = (PeerTier(PeerFetcher(SECRET, index, "b"), b_cache.layout,
                                  asyncio.get_running_loop()),)
        hit, cached = await generate(b, case.prompt)  # T2 lands in b's engine blocks
        assert (cached, hit) == (32, miss)
    finally:
        for e in engines:
            await e.stop()
        if runner is not None:
            await runner.cleanup()


def test_window_hits_stay_exact_across_the_window_edge(cases: dict[str, Case]) -> None:
    """Sliding window and prefix caching: the KV of every token depends on its tokens only, so a
    suffix prefill after a restored prefix equals the full prefill bitwise, also when the prefix
    is longer than the window (blocks the window no longer sees are still restored)."""
    model = cases["mistral-window16"].loaded.model
    args = cases["mistral-window16"].loaded.args
    assert args.sliding_window == 16
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (70,), generator=g).tolist()
    kv_full = PagedKV.allocate(args, 8, device=CPU)
    t_full = kv_full.take(8)
    assert t_full is not None
    logits_full = model.prefill(tokens, 0, t_full, kv_full)
    k_full, v_full = kv_full.gather(t_full, 70)
    for cut in (16, 32, 48, 64):
        kv_hit = PagedKV.allocate(args, 8, device=CPU)
        t_hit = kv_hit.take(8)
        assert t_hit is not None
        kv_hit.scatter(t_hit, k_full[:, :, :cut].clone(), v_full[:, :, :cut].clone())
        assert torch.equal(model.prefill(tokens[cut:], cut, t_hit, kv_hit), logits_full)
        k_hit, v_hit = kv_hit.gather(t_hit, 70)
        assert torch.equal(k_hit, k_full) and torch.equal(v_hit, v_full)



@pytest.mark.skipif(not onednn_packing_supported(CPU, torch.bfloat16),
                    reason="this CPU or torch build has no oneDNN bf16")
@pytest.mark.parametrize("name", list(CASES))
def test_packed_bf16_weights_compute_the_same_model(cases: dict[str, Case], name: str) -> None:
    """Every architecture's projections (biases, tied embeddings, q/k norms, windows) packed
    and fused: prefill and decode logits as the plain bf16 weights give them, to bf16 rounding."""
    case = cases[name]
    runs = []
    for packed in (False, True):
        model = load_checkpoint(case.dir, device=CPU, dtype="bf16").model
        if packed:
            model.pack_linear_weights()
        kv = PagedKV.allocate(model.args, 16, device=CPU)
        table = kv.take(16)
        assert table is not None
        n = len(case.prompt) - 4
        logits = [model.prefill(case.prompt[:n], 0, table, kv)]
        for p in range(n, len(case.prompt)):  # the prompt's own next tokens, not samples
            logits.append(model.decode([case.prompt[p]], [p], [table], kv)[0])
        runs.append(torch.stack(logits).float())
    torch.testing.assert_close(runs[1], runs[0], rtol=5e-2, atol=5e-2)


def test_replica_serves_in_the_chosen_dtype(cases: dict[str, Case], tmp_path: Path) -> None:
    """`--dtype bf16` on a float32 checkpoint: weights, working KV, cache pools and key in bf16."""
    from kvfleet_runtime.server import build_replica, load_config
    from kvfleet_runtime.tokenizer import BYTE_TOKENIZER_DECLARATION, BYTE_TOKENIZER_NAME

    case = cases["qwen2"]
    # The replica needs a tokenizer; this model has none of its own, so it declares the byte one
    # (its 300 ids cover the byte tokenizer's 259).
    served = tmp_path / "qwen2"
    shutil.copytree(case.dir, served)
    config_json = json.loads((served / "config.json").read_text())
    config_json[BYTE_TOKENIZER_DECLARATION] = BYTE_TOKENIZER_NAME
    (served / "config.json").write_text(json.dumps(config_json))
    config = load_config(None, environ={}, overrides={
        "model_dir": str(served), "device": "cpu", "dtype": "bf16",
        "engine": {"num_kv_blocks": 8}, "cache": {"t0_enabled": True, "num_t1_blocks": 8}})
    replica = build_replica(config)
    assert replica.loaded.model.lm_head.weight.dtype == torch.bfloat16
    assert replica.engine.kv.k.dtype == torch.bfloat16
    assert replica.cache is not None and replica.cache.layout.dtype == "bfloat16"
    assert replica.engine.key_fields.kv_dtype == "bfloat16"
    assert replica.loaded.weights_digest == case.loaded.weights_digest
    assert replica.loaded.args.kv_bytes_per_token == case.loaded.args.kv_bytes_per_token // 2
    # served from oneDNN-packed weights where the CPU can, and not when the config says so
    packs = onednn_packing_supported(CPU, torch.bfloat16)
    assert isinstance(replica.loaded.model.lm_head, PackedLinear) == packs
    unpacked = build_replica(config.model_copy(update={"pack_weights": False}))
    assert not isinstance(unpacked.loaded.model.lm_head, PackedLinear)


def test_digest_mismatch_is_reported_before_the_weights_move(
        cases: dict[str, Case], monkeypatch: pytest.MonkeyPatch) -> None:
    case = cases["qwen2"]
    moved: list[str] = []
    real_to = torch.Tensor.to

    def spy(self: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
        if a and isinstance(a[0], torch.device):
            moved.append(str(a[0]))
        return real_to(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "to", spy)
    wrong = "sha256:" + "0" * 64
    with pytest.raises(ValueError, match=f"holds weights {case.loaded.weights_digest}.*{wrong}"):
        load_checkpoint(case.dir, device=CPU, attn_impl=EAGER, expected_digest=wrong)
    assert moved == []
    loaded = load_checkpoint(case.dir, device=CPU, attn_impl=EAGER,
                             expected_digest=case.loaded.weights_digest)
    assert moved and loaded.weights_digest == case.loaded.weights_digest


def test_loaded_state_is_the_files_bytes(cases: dict[str, Case]) -> None:
    """No float32 detour and no rounding: each parameter is exactly the tensor in the file."""
    from safetensors.torch import load_file

    case = cases["llama-bias-tied"]
    state = load_file(str(case.dir / "model.safetensors"))
    own = case.loaded.model.state_dict()
    assert "lm_head.weight" not in state  # tied: transformers does not write it
    for name, tensor in state.items():
        assert torch.equal(own[name.removeprefix("model.")], tensor), name
    assert case.loaded.model.lm_head.weight is case.loaded.model.embed_tokens.weight


def test_a_transformers_checkpoint_serves_sdpa_by_default(cases: dict[str, Case]) -> None:
    """transformers writes no `kvfleet_attn_impl`: such a checkpoint gets SDPA, transformers'
    own default and the CPU's flash kernel, and still computes transformers' logits."""
    case = cases["qwen3"]
    assert "kvfleet_attn_impl" not in json.loads((case.dir / "config.json").read_text())
    loaded = load_checkpoint(case.dir, device=CPU)
    assert loaded.args.attn_impl == "sdpa"
    assert loaded.args.attn_impl_id() != case.loaded.args.attn_impl_id()  # another cache key
    tokens, _ = kvfleet_greedy(loaded, case.prompt, 4)
    assert tokens == kvfleet_greedy(case.loaded, case.prompt, 4)[0]
