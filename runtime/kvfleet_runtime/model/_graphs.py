"""The decode step on fixed shapes, captured in CUDA graphs: one launch per step instead of a few
hundred small kernel launches from Python.

`Transformer.decode_step` has shapes that depend only on (batch, blocks) and reads nothing back
to Python, so it can be recorded once per shape and replayed. Shapes are bucketed (powers of two
up to the batch capacity and the widest block table) so a handful of graphs serves every step:
the step's rows are copied into static input buffers, the rows up to the bucket are padding,
and the logits of the real rows are read back.

Padding is harmless by construction: a padding row is token 0 at position 0 of `pad_block`, a
block the caller reserves for it (nobody else reads or writes it), so its KV write lands there
and its attention sees only that slot; a real row's table columns past its own position are its
own blocks (the caller pads tables that way), hidden by the length mask. Padding changes the
matmuls' shapes, so a padded step agrees with an unpadded one to float tolerance, not bitwise;
decode's KV is never stored in the cache, so no cache guarantee depends on it.

`capture=False` runs the same bucketing, static buffers and padding eagerly (the CPU, and tests
of this machinery without a GPU); `capture=True` needs CUDA. A capture that fails leaves that
bucket eager (logged once), never the step failed.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from kvfleet_runtime.model.model import PagedKV, Transformer

__all__ = ["DecodeGraphs", "bucket"]

log = logging.getLogger(__name__)

WARMUP_RUNS = 2
"""Eager runs on a side stream before a capture, as CUDA graphs need (lazy kernel selection and
allocator warm-up happen outside the recording)."""


def bucket(n: int, cap: int) -> int:
    """The smallest power of two >= n, at most `cap` (n <= cap)."""
    if not 0 < n <= cap:
        raise ValueError(f"{n} is not in [1, {cap}]")
    return min(cap, 1 << (n - 1).bit_length())


class DecodeGraphs:
    """`decode_step` over padded buckets of at most `max_batch` rows and `max_blocks` blocks."""

    def __init__(self, model: Transformer, kv: PagedKV, *, max_batch: int, max_blocks: int,
                 pad_block: int, capture: bool) -> None:
        if capture and model.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.model, self.kv, self.capture = model, kv, capture
        self.max_batch, self.max_blocks, self.pad_block = max_batch, max_blocks, pad_block
        device = model.device
        self.ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.pos = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.table = torch.full((max_batch, max_blocks), pad_block, dtype=torch.long,
                                device=device)
        self._graphs: dict[tuple[int, int], tuple[Any, Tensor]] = {}
        self._eager: set[tuple[int, int]] = set()
        self._pool: Any = None

    @property
    def captured(self) -> int:
        """Buckets recorded so far."""
        return len(self._graphs)

    def __call__(self, ids: Tensor, pos: Tensor, table: Tensor) -> Tensor:
        """As `decode_step(ids, pos, table, kv)` -> logits [B, V]; `table` [B, nb]."""
        b, nb = table.shape
        shape = (bucket(b, self.max_batch), bucket(nb, self.max_blocks))
        bb, nbb = shape
        self.ids[:b].copy_(ids)
        self.pos[:b].copy_(pos)
        self.table[:b, :nb].copy_(table)
        if nbb > nb:  # the rows' own first blocks: real, finite, masked out
            self.table[:b, nb:nbb].copy_(table[:, :1].expand(b, nbb - nb))
        self.ids[b:bb].zero_()
        self.pos[b:bb].zero_()
        self.table[b:bb, :nbb].fill_(self.pad_block)
        if not self.capture or shape in self._eager:
            return self._run(shape)[:b]
        entry = self._graphs.get(shape)
        if entry is None:
            entry = self._record(shape)
            if entry is None:
                return self._run(shape)[:b]
        graph, out = entry
        graph.replay()
        return out[:b]

    def _run(self, shape: tuple[int, int]) -> Tensor:
        bb, nbb = shape
        return self.model.decode_step(self.ids[:bb], self.pos[:bb], self.table[:bb, :nbb],
                                      self.kv)

    def _record(self, shape: tuple[int, int]) -> tuple[Any, Tensor] | None:
        try:
            side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    self._run(shape)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self._run(shape)
            self._pool = graph.pool()  # one memory pool shared by every bucket's graph
        except Exception:
            log.exception("capturing the decode step for %s failed; that shape runs eagerly",
                          shape)
            self._eager.add(shape)
            return None
        self._graphs[shape] = (graph, out)
        return graph, out
