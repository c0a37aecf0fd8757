"""BlockTables: the block tables a runner reads each step, kept as numpy arrays that only what the pool changed is
written into (vLLM's persistent block tables), and TableRows, a batch's rows of them.

A step's inputs need every running sequence's block ids in every KV group as arrays (the decode graph's static
tables, a mixed step's metadata). Read from the pool's lists each step, that was all of them converted every step:
Gemma-4-26B-A4B's six hybrid groups over 48 decode rows, about 20,000 ids, 0.8 ms of a decode step's staging on a
desktop CPU. A BlockTables keeps a row for each sequence it has seen and, each step, writes into it only the entries
its pool table gained (usually none: a block holds 16 steps), so a batch's tables are a gather of rows.

What the mirror relies on (policies.kv_blocks.BlockPool): a table only grows, until it is freed; a table made anew
(a sequence freed and allocated again) is a new list; compaction, the one change to ids already written, counts
`rewrites`, on which every row is read whole again. Entries a sliding window released (NULL_BLOCK in the pool) keep
their old ids here: every reader leaves the entries before a row's window unread (`place_block_tables`).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np

from policies.kv_blocks import NULL_BLOCK, BlockPool
from policies.kv_groups import GroupedBlockPool


@dataclass(frozen=True)
class TableRows:
    """A batch's block tables in one KV group: batch row i's are ids[index[i], :lengths[i]], NULL_BLOCK past them."""

    ids: np.ndarray       # [R, W] int32
    index: np.ndarray     # [n] int64: each batch row's row of `ids`
    lengths: np.ndarray   # [n] int64: each batch row's entries

    @classmethod
    def of(cls, tables: Sequence[Sequence[int]]) -> "TableRows":
        """Tables given as lists, one row each (tests, benchmarks and one-off forwards)."""
        n = len(tables)
        lengths = np.fromiter(map(len, tables), np.int64, n)
        ids = np.full((n, max(1, int(lengths.max(initial=0)))), NULL_BLOCK, np.int32)
        if n:
            ids[np.arange(ids.shape[1]) < lengths[:, None]] = np.fromiter(chain.from_iterable(tables), np.int32,
                                                                           int(lengths.sum()))
        return cls(ids, np.arange(n, dtype=np.int64), lengths)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def max_blocks(self) -> int:
        return int(self.lengths.max(initial=0))


class BlockTables:
    """The block tables of the sequences a runner serves, a [rows, width] int32 array a KV group, brought up to date
    with a pool each time a batch's rows are asked for (module docstring). Rows and columns grow by doubling; when the
    rows run out, those of sequences outside the batch asked for are let go (read whole again if they come back)."""

    def __init__(self, groups: int, rows: int = 8, width: int = 64) -> None:
        if rows < 1 or width < 1:   # they grow by doubling
            raise ValueError(f"block tables start at least one row and one entry wide, got {rows} x {width}")
        self._ids = [np.full((rows, width), NULL_BLOCK, np.int32) for _ in range(groups)]
        self._written = [np.zeros(rows, np.int64) for _ in range(groups)]   # entries written into each row
        self._row_of: dict[Hashable, int] = {}
        self._free = list(range(rows - 1, -1, -1))   # popped from the end: lowest row first
        self._copied: dict[tuple[Hashable, int], tuple[Sequence[int], int]] = {}   # (seq, group) -> (table, entries)
        self._pool: BlockPool | GroupedBlockPool | None = None
        self._rewrites = 0

    @property
    def rows(self) -> int:
        return len(self._free) + len(self._row_of)

    def batch(self, pool: BlockPool | GroupedBlockPool, seq_ids: Sequence[Hashable]) -> list[TableRows]:
        """Each KV group's tables of `seq_ids` (in that order), brought up to date with `pool` first. The arrays are
        this object's own: read them before the next call."""
        if pool is not self._pool or pool.rewrites != self._rewrites:   # another pool, or ids moved: read all again
            self._pool, self._rewrites = pool, pool.rewrites
            self._copied.clear()
        index = np.fromiter((self._row(s, seq_ids) for s in seq_ids), np.int64, len(seq_ids))
        if isinstance(pool, GroupedBlockPool):
            views = [[pool.group_table_view(s, g) for s in seq_ids] for g in range(len(self._ids))]
        else:
            views = [[pool.block_table_view(s) for s in seq_ids]]
        if len(views) != len(self._ids):
            raise ValueError(f"a pool of {len(views)} KV groups for block tables of {len(self._ids)}")
        return [self._update(g, seq_ids, tables, index) for g, tables in enumerate(views)]

    def _row(self, seq_id: Hashable, batch: Sequence[Hashable]) -> int:
        row = self._row_of.get(seq_id)
        if row is None:
            if not self._free:
                self._make_room(set(batch))
            row = self._row_of[seq_id] = self._free.pop()
        return row

    def _make_room(self, keep: set) -> None:
        """Let go every row of a sequence outside `keep`; if none is, double the rows."""
        for seq_id in [s for s in self._row_of if s not in keep]:
            self._free.append(self._row_of.pop(seq_id))
            for g in range(len(self._ids)):
                self._copied.pop((seq_id, g), None)
        if not self._free:
            old = self.rows
            self._ids = [np.concatenate([a, np.full_like(a, NULL_BLOCK)]) for a in self._ids]
            self._written = [np.concatenate([w, np.zeros_like(w)]) for w in self._written]
            self._free = list(range(2 * old - 1, old - 1, -1))

    def _update(self, g: int, seq_ids: Sequence[Hashable], tables: list[Sequence[int]], index: np.ndarray) -> TableRows:
        """Write into group g's rows what each table gained since it was last read (a new table whole)."""
        lengths = np.fromiter(map(len, tables), np.int64, len(tables))
        if lengths.size and lengths.max() > self._ids[g].shape[1]:
            ids = self._ids[g]
            width = ids.shape[1]
            while width < lengths.max():
                width *= 2
            self._ids[g] = np.concatenate([ids, np.full((ids.shape[0], width - ids.shape[1]), NULL_BLOCK, np.int32)],
                                          axis=1)
        ids, written, copied = self._ids[g], self._written[g], self._copied
        for seq_id, table, row, n in zip(seq_ids, tables, index.tolist(), lengths.tolist()):
            seen = copied.get((seq_id, g))
            if seen is not None and seen[0] is table:
                if n > seen[1]:
                    ids[row, seen[1]:n] = table[seen[1]:]
                    copied[seq_id, g] = (table, n)
                    written[row] = n
                continue
            ids[row, :n] = table
            if written[row] > n:
                ids[row, n:written[row]] = NULL_BLOCK
            written[row] = n
            copied[seq_id, g] = (table, n)
        return TableRows(ids, index, lengths)
