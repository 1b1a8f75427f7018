"""Liveness-based storage planning: storage blocks whose lifetimes do not overlap share a buffer.

A plan runs its nodes in a fixed order. A storage block (a root tensor, or a dispatch-private
scratch tensor) is live from the step that first writes it to the last step that reads or
writes it; blocks that must survive a run (leaves, which hold inputs, parameters and
constants, and the plan's outputs) are live throughout. Blocks are packed into buffers
greedily, best fit first, in the order they come to life.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Block:
    key: int          # id of the root tensor
    nbytes: int
    first: int        # step of the first write (-1: live from the start)
    last: int         # step of the last use (a large number: live to the end)


@dataclass
class Layout:
    slot_of: dict         # block key -> buffer index
    slot_bytes: list      # size of each buffer
    peak_bytes: int       # the most bytes live at once (what reuse can reach at best)
    peak_keys: frozenset = frozenset()   # the blocks live at that moment

    @property
    def total_bytes(self) -> int:
        return sum(self.slot_bytes)


def pack(blocks: list[Block]) -> Layout:
    """Assign blocks to buffers so that no two blocks live at the same step share one.

    Largest block first, each into the first buffer none of whose blocks' lifetimes overlap
    its own (a buffer is as large as its first, largest, block): big activations pair up
    across the forward and backward, small ones fill the gaps between them. Sweeping the
    lifetimes in order instead, buffers sized by their first tenant had to grow and left
    20-35 % of a checkpointed step unused. Finding that buffer takes O(log steps) set
    operations (BusySteps), not a look at every buffer: deep graphs have thousands."""
    if len({b.key for b in blocks}) != len(blocks):
        raise ValueError("storage blocks must have distinct keys")
    slot_of, slot_bytes = {}, []
    busy = BusySteps(max((b.last for b in blocks), default=0) + 2)
    for b in sorted(blocks, key=lambda b: (-b.nbytes, b.first)):
        taken = busy.during(b.first + 1, b.last + 1)   # steps start at -1
        slot = ((taken + 1) & ~taken).bit_length() - 1  # the lowest buffer not taken
        if slot == len(slot_bytes):
            slot_bytes.append(b.nbytes)
        busy.take(b.first + 1, b.last + 1, 1 << slot)
        slot_of[b.key] = slot
    peak, peak_keys = live_peak(blocks)
    return Layout(slot_of, slot_bytes, peak, peak_keys)


class BusySteps:
    """Which buffers are busy at which steps: a segment tree over the steps whose nodes hold
    sets of buffers as bits of an int. `whole[n]`: buffers busy over all of node n's steps;
    `some[n]`: busy at one step of it at least. A node that overlaps a range of steps without
    lying inside it contains one of the range's ends, so each query and update walks the
    O(log steps) nodes that cover the range and the two paths from its ends to the root."""

    def __init__(self, n_steps: int):
        self.leaves = 1 << max(0, n_steps - 1).bit_length()
        self.whole = [0] * (2 * self.leaves)
        self.some = [0] * (2 * self.leaves)

    def _cover(self, lo: int, hi: int):
        """The nodes whose steps together are lo .. hi (inclusive)."""
        lo, hi = lo + self.leaves, hi + 1 + self.leaves
        while lo < hi:
            if lo & 1:
                yield lo
                lo += 1
            if hi & 1:
                hi -= 1
                yield hi
            lo, hi = lo >> 1, hi >> 1

    def _ends(self, lo: int, hi: int):
        """The nodes that contain step lo or step hi."""
        for n in (lo + self.leaves, hi + self.leaves):
            while n:
                yield n
                n >>= 1

    def during(self, lo: int, hi: int) -> int:
        """The buffers busy at some step of lo .. hi."""
        bits = 0
        for n in self._cover(lo, hi):
            bits |= self.some[n]
        for n in self._ends(lo, hi):
            bits |= self.whole[n]
        return bits

    def take(self, lo: int, hi: int, bits: int):
        """Mark `bits` busy at steps lo .. hi."""
        for n in self._cover(lo, hi):
            self.whole[n] |= bits
            self.some[n] |= bits
        for n in self._ends(lo, hi):
            self.some[n] |= bits


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
