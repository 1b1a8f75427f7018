"""Liveness-based storage planning: storage blocks whose lifetimes do not overlap share memory.

A plan runs its nodes in a fixed order. A storage block (a root tensor, or a dispatch-private
scratch tensor) is live from the step that first writes it to the last step that reads or
writes it; blocks that must survive a run (leaves, which hold inputs, parameters and
constants, and the plan's outputs) are live throughout. Blocks are placed at byte offsets in
a few large buffers (arenas), largest first, each into the smallest gap that the blocks
already placed and live at the same time leave free (greedy by size, best fit): two blocks
share bytes only when they are never live at once.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Block:
    key: int          # id of the root tensor
    nbytes: int
    first: int        # step of the first write (-1: live from the start)
    last: int         # step of the last use (a large number: live to the end)


@dataclass
class Layout:
    place: dict           # block key -> (buffer index, byte offset, bytes reserved)
    buffer_bytes: list    # size of each buffer
    peak_bytes: int       # the most bytes live at once (what reuse can reach at best)
    peak_keys: frozenset = frozenset()   # the blocks live at that moment
    reused: frozenset = frozenset()      # blocks whose bytes another block also uses

    @property
    def total_bytes(self) -> int:
        return sum(self.buffer_bytes)


def pack(blocks: list[Block], align: int = 16, max_buffer: int | None = None,
         alone=frozenset()) -> Layout:
    """Place blocks in buffers so that no two blocks live at the same step share a byte.

    Offsets and reserved sizes are multiples of `align` (a device's storage binding offset
    alignment); no buffer exceeds `max_buffer` bytes (a new arena is begun instead); the keys
    in `alone` get a buffer of their own (blocks bound in several ranges). Largest block first,
    each at the offset of the smallest free gap among the placed blocks whose lifetimes
    overlap its own, else above them all: on the steps of a training graph this reaches the
    peak of live bytes (a buffer per block size class, reused by liveness, left 25-35 % of a
    checkpointed step unused)."""
    if len({b.key for b in blocks}) != len(blocks):
        raise ValueError("storage blocks must have distinct keys")
    own = [b for b in blocks if b.key in alone]
    place = {b.key: (i, 0, b.nbytes) for i, b in enumerate(own)}
    arenas = []
    for b in sorted((b for b in blocks if b.key not in alone),
                    key=lambda b: (-b.nbytes, b.first)):
        size = max(align, -(-b.nbytes // align) * align)
        for arena in arenas:
            offset = arena.best_fit(b.first, b.last, size)
            if max_buffer is None or offset + size <= max_buffer:
                break
        else:
            arena, offset = Arena(len(blocks)), 0
            arenas.append(arena)
        arena.add(b, offset, size)
        place[b.key] = (len(own) + arenas.index(arena), offset, size)
    reused = frozenset(k for arena in arenas for k in arena.reused())
    peak, peak_keys = live_peak(blocks)
    return Layout(place, [b.nbytes for b in own] + [a.nbytes() for a in arenas],
                  peak, peak_keys, reused)


class Arena:
    """The blocks placed in one buffer: their lifetimes and byte ranges, as arrays."""

    def __init__(self, capacity: int):
        self.n, self.keys = 0, []
        self.first, self.last, self.start, self.end = (np.empty(capacity, np.int64)
                                                       for _ in range(4))

    def add(self, b: Block, offset: int, size: int):
        n = self.n
        self.first[n], self.last[n], self.start[n], self.end[n] = \
            b.first, b.last, offset, offset + size
        self.keys.append(b.key)
        self.n += 1

    def best_fit(self, first: int, last: int, size: int) -> int:
        """The offset of the smallest gap of at least `size` bytes between the blocks live
        at some step of first .. last, else the end of the highest of them."""
        n = self.n
        live = (self.first[:n] <= last) & (self.last[:n] >= first)
        start, end = self.start[:n][live], self.end[:n][live]
        if not len(start):
            return 0
        order = np.argsort(start, kind="stable")
        start, end = start[order], end[order]
        # below block i, the bytes up to the highest end of the blocks before it are taken
        reach = np.concatenate(([0], np.maximum.accumulate(end)[:-1]))
        gaps = start - reach
        fits = np.flatnonzero(gaps >= size)
        if not len(fits):
            return int(end.max())
        return int(reach[fits[np.argmin(gaps[fits])]])

    def nbytes(self) -> int:
        return int(self.end[:self.n].max())

    def reused(self) -> list:
        """The keys of the blocks whose byte range meets another block's."""
        n = self.n
        order = np.argsort(self.start[:n], kind="stable")
        start, end = self.start[:n][order], self.end[:n][order]
        below = np.concatenate(([0], np.maximum.accumulate(end)[:-1])) > start
        above = np.concatenate((start[1:] < end[:-1], [False]))
        return [self.keys[i] for i in order[below | above]]


def live_peak(blocks: list[Block]) -> tuple[int, frozenset]:
    """The most bytes live at one step, and the blocks live then."""
    events = sorted([(b.first, 0, b) for b in blocks] + [(b.last, 1, b) for b in blocks],
                    key=lambda e: (e[0], e[1]))  # at one step: starts before ends
    live_bytes, peak, at = 0, 0, 0
    for i, (_, end, b) in enumerate(events):
        live_bytes += -b.nbytes if end else b.nbytes
        if live_bytes > peak:
            peak, at = live_bytes, i + 1
    live = set()  # replayed once up to the peak: copying the live set at every new peak
    for _, end, b in events[:at]:  # was quadratic in the number of leaves
        if end:
            live.discard(b.key)
        else:
            live.add(b.key)
    return peak, frozenset(live)
