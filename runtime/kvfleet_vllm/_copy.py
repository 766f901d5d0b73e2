"""Block copies between the host pool (vLLM's per-block order) and vLLM's paged KV.

Host pool, one file shared by the engine's processes: `[num_layers, num_slots, num_kv_heads, 16,
2 (K, V), head_dim]`, all heads, whatever the TP degree: each slot of a layer is a 16-token block
as vLLM's LBHNC layout lays it (K and V of a token adjacent), and it is T2's LBHNC wire order
(`kvfleet_runtime.fleet.t2_protocol.WireOrder`), so a fetched run lands in its slots and a served
run leaves from them as they lie. Why this order and not the canonical `[K|V, layer, head, slot,
16, head_dim]` of kvfleet's own pools: against vLLM's layouts, whose last axis is K|V of one
token, the canonical pool's longest common stretch is one head's K (or V) of one token
(`head_dim` values) and its copies reached 0.22-0.84x of a raw copy; here it is K|V of a token
at the least (LBNHC) and a layer's whole block run at the most (LBHNC), at memcpy speed.
vLLM 0.33 hands every attention layer to the connector as a
logical `[blocks, heads, tokens_per_block, 2 * head_dim]` view (K in the first `head_dim` of the
last axis, V in the rest); which axis is outermost in memory is the KV cache layout the attention
backend chose (`vllm.v1.kv_cache_layout.KVCacheLayout`: LBHNC for FlashInfer and the CPU backend,
LBNHC for FlashAttention's default and FlexAttention, ...). The copies index the logical view, so
every layout is one code path; strides are vLLM's business.

What the two sides share: in every layout the last physical axis is K|V of one token, as in the
pool, whose slots are consecutive per layer. A copy is planned as *pieces* (`plan_pieces`): a run
of consecutive host slots that lands on consecutive tokens of consecutive vLLM blocks, copied by
ONE strided `copy_` that moves K and V of every head of the run (and of every layer, when vLLM's
layer views are one tensor at a constant layer stride: `stack_layers`; vLLM 0.33 allocates a
group's layers that way). Per-row writes are torch's inner loop, not Python's: a contiguous
request is one copy for all layers, a scattered one is one copy per block for all layers.

TP: vLLM shards KV heads contiguously (`QKVParallelLinear`: rank r holds heads [r * H/tp,
(r+1) * H/tp)), and when tp > H each head is replicated on tp/H consecutive ranks. kvfleet's own
engine takes heads h % tp == r instead (on its own pools). Every rank reads and writes its heads'
slice of the one pool, so a block stored at TP1 loads into TP2 and TP4 workers. Mapping a vLLM
rank by h % tp would put other heads' KV in its cache: the map is the engine's.

CUDA: the views live on the GPU and the pool in host memory. A load moves the piece's pool-order
slab to the device, ordered on the current stream before the forward reads it (from the mapping
`HostPool.pin` page-locked, a non-blocking DMA when the slab is contiguous; a slab spanning layers
or a rank's share of the heads is first made contiguous by torch in pageable memory), and
interleaves it into vLLM's layout there; a save makes the device piece contiguous in the pool's
order and copies it out before returning (a slot may be read by the next step's load).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfleet_runtime.cache import BLOCK_SIZE, KVLayout, paired_runs
from kvfleet_runtime.fleet import WireOrder, chunk_axes

__all__ = [
    "HostPool",
    "LayerViews",
    "Piece",
    "RankHeads",
    "load_blocks",
    "plan_pieces",
    "save_blocks",
    "stack_layers",
    "view_positions",
]


@dataclass(slots=True, frozen=True)
class RankHeads:
    """The global KV heads one TP rank of a vLLM engine holds, and whether it writes them."""

    start: int
    stop: int
    writer: bool
    """False on the replicas of a head beyond the first (tp > num_kv_heads): one write each."""

    @classmethod
    def for_rank(cls, num_kv_heads: int, tp_size: int, tp_rank: int) -> RankHeads:
        if tp_size <= 0 or not 0 <= tp_rank < tp_size:
            raise ValueError(f"need 0 <= tp_rank < tp_size, got rank {tp_rank} of {tp_size}")
        if tp_size <= num_kv_heads:
            if num_kv_heads % tp_size:
                raise ValueError(f"tp_size {tp_size} must divide num_kv_heads={num_kv_heads}")
            per = num_kv_heads // tp_size
            return cls(tp_rank * per, (tp_rank + 1) * per, True)
        if tp_size % num_kv_heads:
            raise ValueError(f"num_kv_heads={num_kv_heads} must divide tp_size {tp_size}")
        replicas = tp_size // num_kv_heads
        head = tp_rank // replicas
        return cls(head, head + 1, tp_rank % replicas == 0)

    @property
    def num_heads(self) -> int:
        return self.stop - self.start


class HostPool:
    """K and V of `num_slots` blocks in one shared file (`/dev/shm/...` in a pod), so the
    scheduler process plans slots and every worker process copies into the same memory."""

    __slots__ = ("_bytes", "k", "kv", "layout", "num_slots", "path", "pinned", "v")

    order = WireOrder.LBHNC
    """The pool's order, which is also its T2 wire order (see the module docstring)."""

    def __init__(self, path: Path, layout: KVLayout, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"host pool needs > 0 slots, got {num_slots}")
        dtype = getattr(torch, layout.dtype)
        shape = (layout.num_layers, num_slots, layout.num_kv_heads, BLOCK_SIZE, 2,
                 layout.head_dim)
        numel = 1
        for n in shape:
            numel *= n
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # shared=True maps the file MAP_SHARED (created at this size when absent): every
        # process of the engine that opens it sees the same bytes.
        flat = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
        self.kv = flat.view(shape)
        """`[layers, slots, heads, 16, K|V, head_dim]`, as it lies."""
        self.path = path
        self.layout = layout
        self.num_slots = num_slots
        self.k = self.kv[..., 0, :].permute(0, 2, 1, 3, 4)
        """K as `[layers, heads, slots, 16, head_dim]` (a strided view: for checks and gathers)."""
        self.v = self.kv[..., 1, :].permute(0, 2, 1, 3, 4)
        self.pinned = False
        self._bytes: memoryview | None = None

    def wire_views(self, slots: Sequence[int]) -> list[memoryview]:
        """The bytes of `slots` in T2's LBHNC wire order (`kvfleet_runtime.fleet.t2_protocol`:
        per layer, the slots' blocks in turn): one view per layer and run of consecutive slots.
        The pool's order is that wire order, so a fetched chunk is received straight into its
        slots (`PeerFetcher.fetch_into`) and a served run is sent from them
        (`ExportedRun.views`): no copy on either side."""
        if self._bytes is None:
            self._bytes = memoryview(self.kv.view(-1).view(torch.uint8).numpy()).cast("B")
        layout = self.layout
        slot_bytes = layout.bytes_per_block // layout.num_layers
        runs = [(s, n) for s, _, n in paired_runs(slots, range(len(slots)))]
        whole = self._bytes
        return [whole[(layer * self.num_slots + s) * slot_bytes:
                      (layer * self.num_slots + s + n) * slot_bytes]
                for layer in range(layout.num_layers) for s, n in runs]

    def read_into(self, slots: Sequence[int], order: WireOrder, out: memoryview) -> None:
        """Copy `slots` into `out` in wire order `order` (a peer that lands another order than
        the pool's: a kvfleet replica's canonical rows), one copy per run of consecutive slots."""
        layout = self.layout
        shape, perm = chunk_axes(order, len(slots),
                                 (layout.num_layers, layout.num_kv_heads, layout.head_dim))
        dst = torch.frombuffer(out, dtype=torch.uint8).view(self.kv.dtype).view(shape)
        dst = dst.permute(perm)  # [K|V, layers, heads, blocks, 16, head_dim]
        src = self.kv.permute(4, 0, 2, 1, 3, 5)  # the pool the same way, slots for blocks
        for s, i, n in paired_runs(slots, range(len(slots))):
            dst[:, :, :, i:i + n].copy_(src[:, :, :, s:s + n])

    def pin(self) -> bool:
        """Page-lock the mapping for the GPU (`cudaHostRegister`), so host -> device copies are
        DMAs that need not block; False (and nothing changed) without CUDA or when the driver
        refuses. The mapping stays registered for the life of the process."""
        if self.pinned:
            return True
        if not torch.cuda.is_available():
            return False
        num_bytes = self.kv.numel() * self.kv.element_size()
        # flags 1 = cudaHostRegisterPortable: pinned for every CUDA context of the process
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        err = cudart.cudaHostRegister(self.kv.data_ptr(), num_bytes, 1)
        self.pinned = int(err) == 0
        return self.pinned


def view_positions(
    block_table: Sequence[int], chain_blocks: Sequence[int], *, vllm_block_size: int,
    view_block_tokens: int,
) -> list[tuple[int, int]]:
    """(view block, token offset) of each kvfleet 16-token block `chain_blocks[i]` (its index in
    the request's chain) in a layer view of `view_block_tokens` tokens per block, for a request
    whose vLLM block table (manager blocks of `vllm_block_size` tokens) is `block_table`. A view
    block is smaller than a manager block when the backend splits blocks into kernel blocks."""
    ratio = vllm_block_size // view_block_tokens
    per = vllm_block_size // BLOCK_SIZE
    out = []
    for j in chain_blocks:
        offset = (j % per) * BLOCK_SIZE
        out.append((block_table[j // per] * ratio + offset // view_block_tokens,
                    offset % view_block_tokens))
    return out


@dataclass(slots=True, frozen=True)
class Piece:
    """One copy: host slots `slot .. slot + num_blocks * num_subs` <-> tokens `[sub * 16,
    (sub + num_subs) * 16)` of view blocks `block .. block + num_blocks`, in that order (the
    slots of one view block are consecutive, and so are the view blocks)."""

    slot: int
    block: int
    sub: int
    num_blocks: int
    num_subs: int

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.num_subs


def plan_pieces(
    positions: Sequence[tuple[int, int]], slots: Sequence[int], *, view_block_tokens: int
) -> list[Piece]:
    """The fewest pieces that copy host slot `slots[i]` to/from `positions[i]` (view block,
    token offset, from `view_positions`) in a view of `view_block_tokens` tokens per block.

    Each 16-token unit is numbered `block * r + offset // 16` (r units per view block); a run
    along which slots and units are both consecutive is one piece, split only where the copy
    cannot be one strided view: a run that starts or ends inside a view block keeps its partial
    first and last blocks as pieces of their own."""
    if len(positions) != len(slots):
        raise ValueError(f"{len(positions)} positions for {len(slots)} slots")
    if view_block_tokens <= 0 or view_block_tokens % BLOCK_SIZE:
        raise ValueError(f"view blocks must be whole {BLOCK_SIZE}-token blocks, got "
                         f"{view_block_tokens} tokens")
    r = view_block_tokens // BLOCK_SIZE
    units = [block * r + offset // BLOCK_SIZE for block, offset in positions]
    return [p for run in paired_runs(slots, units) for p in _run_pieces(*run, r)]


def _run_pieces(slot: int, unit: int, n: int, r: int) -> list[Piece]:
    """One run of n units from `unit` (r units per view block): its partial first view block,
    its whole middle blocks, its partial last block, each one piece where present."""
    pieces = []
    if unit % r:
        k = min(n, r - unit % r)
        pieces.append(Piece(slot, unit // r, unit % r, 1, k))
        slot, unit, n = slot + k, unit + k, n - k
    if n >= r:
        m = n // r
        pieces.append(Piece(slot, unit // r, 0, m, r))
        slot, unit, n = slot + m * r, unit + m * r, n - m * r
    if n:
        pieces.append(Piece(slot, unit // r, 0, 1, n))
    return pieces


@dataclass(slots=True, frozen=True)
class LayerViews:
    """vLLM's views of layers `first_layer .. first_layer + kv.shape[0]` as one tensor
    `[layers, blocks, heads, tokens_per_block, 2 * head_dim]` (for one layer: its view with a
    leading axis of 1)."""

    first_layer: int
    kv: torch.Tensor

    @classmethod
    def of(cls, layer: int, view: torch.Tensor) -> LayerViews:
        return cls(layer, view.unsqueeze(0))

    @property
    def num_layers(self) -> int:
        return int(self.kv.shape[0])

    @property
    def block_tokens(self) -> int:
        return int(self.kv.shape[3])


def stack_layers(views: Sequence[torch.Tensor]) -> LayerViews | None:
    """Layers 0..len(views) as ONE strided tensor when vLLM placed them in one allocation at a
    constant layer stride (what vLLM 0.33 does for a group's same-shaped layers, in every
    layout), so each piece is one copy for all layers; None when they are not (then each layer
    is copied on its own: correct, more copies)."""
    first = views[0]
    if first.dim() != 4:
        return None
    if len(views) == 1:
        return LayerViews.of(0, first)
    if any(v.shape != first.shape or v.stride() != first.stride() or v.dtype != first.dtype
           or v.device != first.device
           or v.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
           for v in views):
        return None
    step = views[1].storage_offset() - first.storage_offset()
    if step <= 0 or any(v.storage_offset() - first.storage_offset() != i * step
                        for i, v in enumerate(views)):
        return None
    stacked = first.as_strided((len(views), *first.shape), (step, *first.stride()),
                               first.storage_offset())
    return LayerViews(0, stacked)


_SERIAL_PIECE_BYTES = 4 << 20
"""Pieces smaller than this on average copy on one intra-op thread: a parallel region per
512 KiB copy costs more than it gains, and on a busy host every region waits for a descheduled
thread (scattered ids fell to 0.02-0.20x of a raw copy with 2 threads on the shared 2-core
box, and held 0.23-0.46x on one)."""


@contextmanager
def _threads_for(num_pieces: int, num_bytes: int, device: torch.device) -> Iterator[None]:
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1 or num_pieces < 2 \
            or num_bytes >= _SERIAL_PIECE_BYTES * num_pieces:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _copy_pieces(pool: HostPool, views: LayerViews, heads: RankHeads, pieces: Sequence[Piece],
                 *, save: bool) -> int:
    """The one copy loop, both directions: one `copy_` per piece. Returns the copies made.

    Both sides are first viewed in the pool's axis order, `[layers, slots | (blocks, 16-token
    units), heads, 16, 2, head_dim]` (vLLM's side a strided view: its tokens split into units,
    its last axis into K|V), so a piece is one slice of each."""
    lo, num_layers = views.first_layer, views.num_layers
    host = pool.kv[lo:lo + num_layers, :, heads.start:heads.stop]
    layers, num_blocks, num_heads, tokens, width = views.kv.shape
    paged = views.kv.view(layers, num_blocks, num_heads, tokens // BLOCK_SIZE, BLOCK_SIZE, 2,
                          width // 2).permute(0, 1, 3, 2, 4, 5, 6)
    _, _, _, _, two, d = host.shape
    device = views.kv.device
    slot_bytes = host.element_size() * two * num_layers * num_heads * BLOCK_SIZE * d
    with _threads_for(len(pieces), slot_bytes * sum(p.num_slots for p in pieces), device):
        for p in pieces:
            h = host[:, p.slot:p.slot + p.num_slots].view(
                num_layers, p.num_blocks, p.num_subs, num_heads, BLOCK_SIZE, two, d)
            v = paged[:, p.block:p.block + p.num_blocks, p.sub:p.sub + p.num_subs]
            if device.type == "cpu":
                (h if save else v).copy_(v if save else h)
            elif save:  # stage in the pool's order on the device, then one copy out (blocking)
                h.copy_(v.contiguous())
            else:  # the pool-order slab crosses (a DMA when pinned), interleaved on the device
                v.copy_(h.to(device, non_blocking=pool.pinned))
    return len(pieces)


def load_blocks(pool: HostPool, views: LayerViews, heads: RankHeads,
                pieces: Sequence[Piece]) -> int:
    """Copy the pieces' host slots into `views` (this rank's heads). Returns the copies made."""
    return _copy_pieces(pool, views, heads, pieces, save=False)


def save_blocks(pool: HostPool, views: LayerViews, heads: RankHeads,
                pieces: Sequence[Piece]) -> int:
    """Copy `views` at the pieces into their host slots; a replica rank (not the head's
    writer) writes nothing. Returns the copies made."""
    if not heads.writer:
        return 0
    return _copy_pieces(pool, views, heads, pieces, save=True)
