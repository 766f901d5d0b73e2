"""The connector's worker side (one per TP rank): vLLM's registered KV views, and the step's
loads (before the forward) and saves (after it) between them and the host pool (`_copy`).
Torch only: `connector` hands over the layer indices and unwraps vLLM's metadata."""

from __future__ import annotations

import logging

import torch

from kvfleet_runtime.cache import BLOCK_SIZE, KVLayout
from kvfleet_vllm._connector_index import LoadPlan, SavePlan
from kvfleet_vllm._copy import (
    HostPool,
    LayerViews,
    Piece,
    RankHeads,
    load_blocks,
    plan_pieces,
    save_blocks,
    stack_layers,
    view_positions,
)
from kvfleet_vllm._options import ConnectorOptions

__all__ = ["WorkerSide"]

logger = logging.getLogger(__name__)


class WorkerSide:
    def __init__(self, opts: ConnectorOptions, layout: KVLayout, *, vllm_block_size: int,
                 tp_size: int, tp_rank: int) -> None:
        self.layout = layout
        self.block_size = vllm_block_size
        self.heads = RankHeads.for_rank(layout.num_kv_heads, tp_size, tp_rank)
        self.pool = HostPool(opts.host_pool_path, layout, opts.num_host_blocks)
        self._layers: dict[str, tuple[int, torch.Tensor]] = {}
        self._targets: list[LayerViews] = []
        self._saved_layers: dict[int, torch.Tensor] = {}
        self._load_errors: set[int] = set()
        self._failed_stores: set[int] = set()
        self._step_id = -1

    def register(self, kv_caches: dict[str, tuple[int, torch.Tensor]]) -> None:
        """vLLM's KV view of each attention layer, by name, with the layer's index."""
        layout = self.layout
        layers: dict[str, tuple[int, torch.Tensor]] = {}
        for name, (index, view) in kv_caches.items():
            expected = (self.heads.num_heads, 2 * layout.head_dim)
            if view.dim() != 4 or (view.shape[1], view.shape[3]) != expected:
                raise ValueError(
                    f"kvfleet connector: layer {name} KV view is {tuple(view.shape)}; expected "
                    f"[blocks, {expected[0]} heads, tokens, {expected[1]}] (K and V of "
                    "head_dim each in the last axis)")
            if view.dtype != getattr(torch, layout.dtype):
                raise ValueError(f"kvfleet connector: layer {name} KV is {view.dtype}, the "
                                 f"host pool holds {layout.dtype}")
            tokens = view.shape[2]
            if tokens % BLOCK_SIZE or self.block_size % tokens:
                raise ValueError(f"kvfleet connector: layer {name} has {tokens}-token blocks; "
                                 f"need a multiple of {BLOCK_SIZE} dividing {self.block_size}")
            if not 0 <= index < layout.num_layers:
                raise ValueError(f"kvfleet connector: layer {name} index {index} is outside "
                                 f"[0, {layout.num_layers})")
            layers[name] = (index, view)
        by_index = {i: v for i, v in layers.values()}
        if len(by_index) != layout.num_layers:
            raise ValueError(f"kvfleet connector: {len(layers)} KV layers registered, the model "
                             f"has {layout.num_layers}")
        self._layers = layers
        # One copy per piece for every layer when vLLM's layers share one strided allocation;
        # otherwise one per piece and layer.
        stacked = stack_layers([by_index[i] for i in range(layout.num_layers)])
        self._targets = ([stacked] if stacked is not None
                         else [LayerViews.of(i, by_index[i]) for i in range(layout.num_layers)])
        if any(v.is_cuda for v in by_index.values()) and not self.pool.pin():
            logger.warning("kvfleet connector: could not page-lock the host pool; host -> GPU "
                           "copies go through pageable memory")

    def _pieces(self, chain: tuple[int, ...], table: tuple[int, ...], slots: tuple[int, ...],
                views: LayerViews) -> list[Piece]:
        positions = view_positions(table, chain, vllm_block_size=self.block_size,
                                   view_block_tokens=views.block_tokens)
        return plan_pieces(positions, slots, view_block_tokens=views.block_tokens)

    def _blocks_of(self, chain: tuple[int, ...], table: tuple[int, ...]) -> set[int]:
        per = self.block_size // BLOCK_SIZE
        return {table[j // per] for j in chain}

    def load(self, step_id: int, loads: list[tuple[LoadPlan, tuple[int, ...]]]) -> None:
        """The step's loads, before the forward reads the blocks."""
        self._step_id = step_id
        for plan, table in loads:
            if plan.failed:
                self._load_errors |= self._blocks_of(plan.chain_blocks, table)
                continue
            try:
                for views in self._targets:
                    load_blocks(self.pool, views, self.heads,
                                self._pieces(plan.chain_blocks, table, plan.slots, views))
            except Exception:  # any failure degrades to recompute, never to wrong KV
                logger.exception("kvfleet connector: load for %s failed", plan.req_id)
                self._load_errors |= self._blocks_of(plan.chain_blocks, table)

    def layer_written(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        # The copies wait for `save` (end of the forward, every layer written): then one copy
        # per piece moves all layers at once. A layer's saved blocks are complete prompt
        # blocks, which nothing rewrites before the step ends.
        entry = self._layers.get(layer_name)
        if entry is not None:
            self._saved_layers[entry[0]] = kv_layer

    def save(self, saves: list[tuple[SavePlan, tuple[int, ...]]]) -> None:
        """The step's saves, once every layer is written; returns when they are in host
        memory (a later step's load may read those slots)."""
        saved, self._saved_layers = self._saved_layers, {}
        if not saved:
            return
        registered = {index: view for index, view in self._layers.values()}
        if saved.keys() == registered.keys() and all(saved[i] is registered[i] for i in saved):
            targets = self._targets
        else:  # only some layers reported, or other tensors than registered: those, one by one
            targets = [LayerViews.of(i, view) for i, view in sorted(saved.items())]
        for plan, table in saves:
            if plan.store_id in self._failed_stores:
                continue
            try:
                for views in targets:
                    save_blocks(self.pool, views, self.heads,
                                self._pieces(plan.chain_blocks, table, plan.slots, views))
            except Exception:  # the blocks are never served; the request is unaffected
                logger.exception("kvfleet connector: save for %s failed", plan.req_id)
                self._failed_stores.add(plan.store_id)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_step_report(self) -> tuple[int, set[int]] | None:
        """(the step the workers finished, the saves that failed), once per step loaded."""
        if self._step_id < 0:
            return None
        failed, self._failed_stores = self._failed_stores, set()
        return self._step_id, failed
