"""Checkpoints in the Hugging Face layout: `config.json` + `model.safetensors` (or shards).

`generate_checkpoint` writes a deterministic random checkpoint (same preset and seed -> the same
bytes, so the same weights digest on every machine). `load_checkpoint` reads a checkpoint of any
architecture in `kvfleet_runtime.model.architectures` the way a serving engine does:

- the model is built on the meta device (no random init, no memory), then each tensor is read
  straight from the file into its own buffer and assigned (`assign=True`): no second copy;
- in the checkpoint's own dtype, or a chosen serving dtype (bf16/fp16/fp32) converted tensor by
  tensor: never a float32 copy of a bf16 model;
- the weights digest is computed from the bytes as they are read (one pass, hashed on a second
  thread while the next tensor is read), and an expected digest that does not match is reported
  before any tensor moves to the device;
- sharded checkpoints (`model.safetensors.index.json`) load from the files the index names.

Host memory peaks at about one checkpoint (the tensors, before they move to a GPU; on CPU they are
the model). The weights digest is "sha256:" + SHA-256 over the bytes of the weight files in
file-name order (for one file: `sha256sum model.safetensors`); it is the cache key's weights field,
never a tag.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors.torch import save_file

from kvfleet_runtime.model.architectures import ModelArgs, parse_dtype, parse_hf_config
from kvfleet_runtime.model.model import Transformer, torch_dtype
from kvfleet_runtime.tokenizer import BYTE_TOKENIZER_DECLARATION, BYTE_TOKENIZER_NAME

__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "WEIGHTS_FILE",
    "CheckpointReport",
    "LoadedModel",
    "TensorEntry",
    "args_from_hf_config",
    "args_to_hf_config",
    "checkpoint_args",
    "default_device",
    "generate_checkpoint",
    "inspect_checkpoint",
    "load_checkpoint",
    "read_config",
    "read_header",
    "weight_files",
    "weights_digest",
]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Our module names are Hugging Face's minus the "model." prefix (lm_head has none).
_HF_PREFIX = "model."

_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64",
              "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
              "BOOL": "bool"}
_MAX_HEADER_BYTES = 100 << 20


@dataclass(slots=True)
class LoadedModel:
    model: Transformer
    args: ModelArgs
    weights_digest: str
    model_dir: Path


@dataclass(slots=True, frozen=True)
class TensorEntry:
    """One tensor of a safetensors file, as its header describes it."""

    name: str
    dtype: str
    """torch dtype name."""
    shape: tuple[int, ...]
    begin: int
    end: int
    """Byte offsets relative to the end of the header."""


def read_header(path: Path) -> tuple[int, list[TensorEntry]]:
    """(data offset, entries in file order) of a safetensors file; ValueError when malformed."""
    with path.open("rb") as f:
        return _parse_header(path, f)


def _parse_header(path: Path, f: BinaryIO) -> tuple[int, list[TensorEntry]]:
    raw = f.read(8)
    if len(raw) != 8:
        raise ValueError(f"{path} is not a safetensors file (shorter than 8 bytes)")
    (length,) = struct.unpack("<Q", raw)
    if length > _MAX_HEADER_BYTES:
        raise ValueError(f"{path} is not a safetensors file (header of {length} bytes)")
    try:
        header = json.loads(f.read(length))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: unreadable safetensors header ({exc})") from exc
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
        begin, end = info["data_offsets"]
        entries.append(TensorEntry(name, dtype, tuple(int(d) for d in info["shape"]),
                                   int(begin), int(end)))
    entries.sort(key=lambda e: e.begin)
    return 8 + length, entries


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files, in name order: the index's shards, else model.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{index} has no readable 'weight_map' ({exc})") from exc
        files = [model_dir / n for n in names]
        absent = [str(p.name) for p in files if not p.is_file()]
        if absent:
            raise ValueError(f"{index} names {absent[0]!r}, which is not in {model_dir}")
        return files
    single = model_dir / WEIGHTS_FILE
    if single.is_file():
        return [single]
    if (model_dir / "pytorch_model.bin").is_file() or list(model_dir.glob("*.bin")):
        raise ValueError(f"{model_dir} holds PyTorch .bin weights only; kvfleet loads "
                         "safetensors (never pickles)")
    raise ValueError(f"no {WEIGHTS_FILE} or {INDEX_FILE} in {model_dir}")


def weights_digest(model_dir: Path) -> str:
    h = hashlib.sha256()
    for path in weight_files(model_dir):
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


def read_config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def checkpoint_args(model_dir: Path, *, attn_impl: str | None = None, dtype: str | None = None
                    ) -> tuple[ModelArgs, list[tuple[Path, int, list[TensorEntry]]]]:
    """Parse and check a checkpoint without reading its tensors: (args, per-file headers).

    Raises ValueError naming what is refused: the config field, or the tensors that do not match
    what the config describes (with the reason when it is a known one)."""
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    files = [(path, *read_header(path)) for path in weight_files(model_dir)]
    if dtype is None:
        floats = {e.dtype for _, _, entries in files for e in entries
                  if e.dtype in ("float32", "float16", "bfloat16")}
        dtype = floats.pop() if len(floats) == 1 else None
    args = parse_hf_config(config, attn_impl=attn_impl, dtype=dtype)
    _check_tensors(model_dir, args, [e for _, _, entries in files for e in entries])
    return args, files


def _check_tensors(model_dir: Path, args: ModelArgs, entries: list[TensorEntry]) -> None:
    expected = args.expected_tensors()
    found = {e.name: e for e in entries}
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if args.tie_word_embeddings and "lm_head.weight" in unexpected:
        unexpected.remove("lm_head.weight")  # checked equal to the embeddings when loading
    if missing or unexpected:
        reasons = []
        if "lm_head.weight" in missing:
            reasons.append("lm_head.weight is missing and tie_word_embeddings is false")
        if any(n.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias"))
               for n in unexpected):
            reasons.append("the checkpoint has attention biases the config does not declare "
                           "(attention_bias)")
        if any(n.endswith(("q_norm.weight", "k_norm.weight")) for n in unexpected):
            reasons.append(f"the checkpoint has q/k norms, which {args.architecture} lacks")
        why = ("; ".join(reasons) + "; ") if reasons else ""
        raise ValueError(f"checkpoint {model_dir} does not match its config: {why}"
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, shape in expected.items():
        if found[name].shape != shape:
            raise ValueError(f"checkpoint {model_dir}: tensor {name} has shape "
                             f"{list(found[name].shape)}, the config implies {list(shape)}")


def args_to_hf_config(args: ModelArgs) -> dict[str, Any]:
    """The generated (Llama) checkpoint's config.json."""
    if args.architecture != "LlamaForCausalLM" or args.qkv_bias != args.o_bias:
        raise ValueError(f"generated checkpoints are Llama-style, got {args.architecture}")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "intermediate_size": args.intermediate_size,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": args.rope_scaling,
        "max_position_embeddings": args.max_seq_len,
        "hidden_act": "silu",
        "attention_bias": args.qkv_bias,
        "mlp_bias": args.mlp_bias,
        "tie_word_embeddings": args.tie_word_embeddings,
        "torch_dtype": args.dtype,
        "kvfleet_attn_impl": args.attn_impl,
    }


def args_from_hf_config(config: dict[str, Any], *, attn_impl: str | None = None) -> ModelArgs:
    """`config.json` -> ModelArgs (see `kvfleet_runtime.model.architectures.parse_hf_config`)."""
    return parse_hf_config(config, attn_impl=attn_impl)


def generate_checkpoint(out_dir: Path, args: ModelArgs, *, seed: int = 0) -> str:
    """Write a deterministic random checkpoint; returns its weights digest."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = args_to_hf_config(args)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    dtype = torch_dtype(args.dtype)
    # Drawn in our module-name order, so the bytes stay those of earlier releases.
    for hf_name, shape in sorted(args.expected_tensors().items(),
                                 key=lambda item: _module_name(item[0])):
        if hf_name.endswith("norm.weight"):
            # Near 1, not exactly 1, so a loader that drops a norm weight fails the tests.
            value = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif hf_name.endswith(".bias"):
            value = 0.1 * torch.randn(shape, generator=gen)
        else:
            fan_in = shape[-1] if hf_name != "model.embed_tokens.weight" else 1
            value = torch.randn(shape, generator=gen) / fan_in**0.5
        tensors[hf_name] = value.to(dtype).contiguous()
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    # safetensors writes 0600; a checkpoint is read by the serving uid (10001 in the image), which
    # is rarely the uid that generated it.
    (out_dir / WEIGHTS_FILE).chmod(0o644)
    # The generated model has no trained tokenizer: it declares the byte tokenizer (a folder
    # without a tokenizer or a declaration is refused).
    config = {**config, BYTE_TOKENIZER_DECLARATION: BYTE_TOKENIZER_NAME}
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return weights_digest(out_dir)


def load_checkpoint(model_dir: Path, *, device: torch.device | None = None,
                    attn_impl: str | None = None, dtype: str | None = None,
                    expected_digest: str | None = None) -> LoadedModel:
    """Load for serving; `dtype` (bf16/fp16/fp32) defaults to the checkpoint tensors' dtype.

    Raises ValueError for a refused config or checkpoint, and for weights whose digest is not
    `expected_digest` (checked before anything moves to the device)."""
    model_dir = Path(model_dir)
    args, files = checkpoint_args(model_dir, attn_impl=attn_impl,
                                  dtype=parse_dtype(dtype) if dtype else None)
    target = torch_dtype(args.dtype)
    hasher = hashlib.sha256()
    state: dict[str, torch.Tensor] = {}
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvfleet-digest") as pool:
        pending: list[Future[None]] = []
        for path, data_start, entries in files:
            for name, raw in _read_tensors(path, data_start, entries, hasher, pool, pending):
                state[name] = raw if raw.dtype == target else raw.to(target)
        for fut in pending:
            fut.result()
    digest = "sha256:" + hasher.hexdigest()
    if expected_digest and expected_digest != digest:
        raise ValueError(f"{model_dir} holds weights {digest}, but {expected_digest} was "
                         "expected (KVFLEET_WEIGHTS_DIGEST)")
    if args.tie_word_embeddings and "lm_head.weight" in state:
        stored = state.pop("lm_head.weight")
        if not torch.equal(stored, state["model.embed_tokens.weight"]):
            raise ValueError(f"checkpoint {model_dir}: tie_word_embeddings is true but "
                             "lm_head.weight differs from the embeddings")
    device = device or default_device()
    own: dict[str, torch.Tensor] = {}
    for name in list(state):
        own[_module_name(name)] = state.pop(name).to(device)  # host copy freed as it moves
    with torch.device("meta"):
        model = Transformer(args)
    if args.tie_word_embeddings:
        own["lm_head.weight"] = own["embed_tokens.weight"]
    model.load_state_dict(own, strict=True, assign=True)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.requires_grad_(False)
    model.reset_rope()
    model.eval()
    return LoadedModel(model=model, args=args, weights_digest=digest, model_dir=model_dir)


def _read_tensors(path: Path, data_start: int, entries: list[TensorEntry],
                  hasher: Any, pool: ThreadPoolExecutor, pending: list[Future[None]]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of one file, read into its own buffer; every byte of the file hashed."""
    with path.open("rb", buffering=0) as f:
        # Every update goes through the one worker, so the bytes are hashed in file order.
        pending.append(pool.submit(hasher.update, _read_exact(f, data_start, path)))
        pos = 0
        for entry in entries:
            if entry.begin < pos:
                raise ValueError(f"{path}: tensor {entry.name} overlaps the previous one")
            if entry.begin > pos:
                pending.append(pool.submit(hasher.update, _read_exact(f, entry.begin - pos,
                                                                     path)))
            buf = torch.empty(entry.end - entry.begin, dtype=torch.uint8)
            view = memoryview(buf.numpy())  # type: ignore[arg-type]  # numpy arrays are buffers
            _read_into(f, view, path)
            pending.append(pool.submit(hasher.update, view))  # in order: one worker
            pos = entry.end
            tensor = buf.view(torch_dtype(entry.dtype)) if buf.numel() else torch.empty(
                0, dtype=torch_dtype(entry.dtype))
            yield entry.name, tensor.reshape(entry.shape)
        while tail := f.read(1 << 22):
            pending.append(pool.submit(hasher.update, tail))


def _read_into(f: BinaryIO, view: memoryview, path: Path) -> None:
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])  # type: ignore[attr-defined]
        if not n:
            raise ValueError(f"{path} is truncated")
        done += n


def _read_exact(f: BinaryIO, n: int, path: Path) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ValueError(f"{path} is truncated")
    return data


@dataclass(slots=True, frozen=True)
class CheckpointReport:
    """What `kvfleet model inspect` prints: read from the config and the file headers."""

    model_dir: str
    architecture: str
    supported: bool
    reason: str | None
    """Why the checkpoint is refused (the loader's own error), None when supported."""
    num_params: int
    checkpoint_dtype: str
    serving_dtype: str | None
    kv_bytes_per_token: int | None
    checkpoint_bytes: int
    num_files: int
    weights_digest: str | None

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


def inspect_checkpoint(model_dir: Path, *, dtype: str | None = None,
                       digest: bool = True) -> CheckpointReport:
    """Report a checkpoint without loading it; ValueError only when the folder is unreadable."""
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    names = config.get("architectures")
    architecture = (str(names[0]) if isinstance(names, list) and names
                    else str(config.get("model_type", "?")))
    files = [(path, *read_header(path)) for path in weight_files(model_dir)]
    entries = [e for _, _, es in files for e in es]
    dtypes = sorted({e.dtype for e in entries})
    reason: str | None = None
    args: ModelArgs | None = None
    try:
        args, _ = checkpoint_args(model_dir, dtype=parse_dtype(dtype) if dtype else None)
    except ValueError as exc:
        reason = str(exc)
    tied = args.tie_word_embeddings if args is not None else bool(
        config.get("tie_word_embeddings"))
    num_params = sum(math.prod(e.shape) for e in entries
                     if not (tied and e.name == "lm_head.weight"))
    return CheckpointReport(
        model_dir=str(model_dir), architecture=architecture, supported=args is not None,
        reason=reason, num_params=num_params, checkpoint_dtype="/".join(dtypes) or "none",
        serving_dtype=args.dtype if args else None,
        kv_bytes_per_token=args.kv_bytes_per_token if args else None,
        checkpoint_bytes=sum(p.stat().st_size for p, _, _ in files), num_files=len(files),
        weights_digest=weights_digest(model_dir) if digest else None,
    )


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _module_name(name: str) -> str:
    return name.removeprefix(_HF_PREFIX)
