"""The decoding sequences' model inputs, kept across steps instead of rebuilt (a persistent batch).

Each decoding sequence owns one row: its block table (padded with its own first block: real,
finite KV that the length mask hides), its next position and its last token. A row is written
once, when the sequence produces its first token; a step then only writes the batch's new tokens
(one copy) and moves every position on by one (one add), so preparing a decode costs the same at
1 and at 32 sequences. A sequence that ends gives its row to the last one (one row copy), so the
rows stay packed at the front and the step's inputs are plain slices.

The engine's thread is the only one that touches a batch.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import torch
from torch import Tensor

from kvfleet_runtime.wire import BLOCK_SIZE

__all__ = ["DecodeBatch"]

S = TypeVar("S")


class DecodeBatch(Generic[S]):
    """Rows for up to `capacity` sequences of at most `max_blocks` blocks each, on `device`."""

    def __init__(self, capacity: int, max_blocks: int, device: torch.device) -> None:
        self.capacity, self.max_blocks, self.device = capacity, max_blocks, device
        self.ids = torch.zeros(capacity, dtype=torch.long, device=device)
        self.pos = torch.zeros(capacity, dtype=torch.long, device=device)
        self.tables = torch.zeros(capacity, max_blocks, dtype=torch.long, device=device)
        self.seqs: list[S] = []
        self._rows: dict[int, int] = {}  # id(seq) -> row
        self._positions: list[int] = []  # the rows' positions, so the step's width needs no sync

    def __len__(self) -> int:
        return len(self.seqs)

    def __contains__(self, seq: S) -> bool:
        return id(seq) in self._rows

    def add(self, seq: S, table: list[int], position: int, token: int) -> None:
        """A sequence starts decoding: `token` (its last) sits at `position`."""
        row = len(self.seqs)
        if row >= self.capacity:
            raise ValueError(f"the decode batch holds {self.capacity} sequences")
        if not table or len(table) > self.max_blocks or position // BLOCK_SIZE >= len(table):
            raise ValueError(f"a table of {len(table)} blocks cannot hold position {position} "
                             f"(at most {self.max_blocks} blocks)")
        padded = table + [table[0]] * (self.max_blocks - len(table))
        self.tables[row].copy_(torch.tensor(padded, dtype=torch.long), non_blocking=True)
        self.pos[row] = position
        self.ids[row] = token
        self.seqs.append(seq)
        self._rows[id(seq)] = row
        self._positions.append(position)

    def remove(self, seq: S) -> None:
        """The sequence ends; the last row moves into its place."""
        row = self._rows.pop(id(seq))
        last = len(self.seqs) - 1
        if row != last:
            moved = self.seqs[last]
            self.tables[row] = self.tables[last]
            self.pos[row] = self.pos[last]
            self.ids[row] = self.ids[last]
            self.seqs[row] = moved
            self._positions[row] = self._positions[last]
            self._rows[id(moved)] = row
        self.seqs.pop()
        self._positions.pop()

    def inputs(self) -> tuple[Tensor, Tensor, Tensor]:
        """ids [B], positions [B], tables [B, nb]: nb blocks cover the furthest position."""
        b = len(self.seqs)
        n_blocks = max(self._positions) // BLOCK_SIZE + 1
        return self.ids[:b], self.pos[:b], self.tables[:b, :n_blocks]

    def advance(self, tokens: list[int]) -> None:
        """Every row's next input: `tokens` in row order, one position further on."""
        b = len(self.seqs)
        if len(tokens) != b:
            raise ValueError(f"{len(tokens)} tokens for {b} rows")
        if b == 0:
            return
        self.ids[:b].copy_(torch.tensor(tokens, dtype=torch.long), non_blocking=True)
        self.pos[:b] += 1
        self._positions = [p + 1 for p in self._positions]
