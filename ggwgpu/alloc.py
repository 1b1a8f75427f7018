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
    """Assign blocks to buffers so that no two blocks live at the same step share one."""
    if len({b.key for b in blocks}) != len(blocks):
        raise ValueError("storage blocks must have distinct keys")
    slot_of, slot_bytes, free = {}, [], []   # free: buffer indices not in use now
    by_start = sorted(blocks, key=lambda b: (b.first, -b.nbytes))
    ending = sorted(blocks, key=lambda b: b.last)
    live_bytes = peak = 0
    live, peak_keys = set(), frozenset()
    e = 0
    for b in by_start:
        while e < len(ending) and ending[e].last < b.first:   # blocks dead before b starts
            done = ending[e]
            if done.key in slot_of:
                free.append(slot_of[done.key])
                live_bytes -= done.nbytes
                live.discard(done.key)
            e += 1
        fits = [s for s in free if slot_bytes[s] >= b.nbytes]
        if fits:
            slot = min(fits, key=lambda s: slot_bytes[s])
            free.remove(slot)
        elif free:  # grow the biggest free buffer rather than add one more
            slot = max(free, key=lambda s: slot_bytes[s])
            free.remove(slot)
            slot_bytes[slot] = b.nbytes
        else:
            slot = len(slot_bytes)
            slot_bytes.append(b.nbytes)
        slot_of[b.key] = slot
        live_bytes += b.nbytes
        live.add(b.key)
        if live_bytes > peak:
            peak, peak_keys = live_bytes, frozenset(live)
    return Layout(slot_of, slot_bytes, peak, peak_keys)
