"""A CUDA memory snapshot's trace replayed into the caching allocator's block sizes (``memlab explain``'s engine).

A snapshot's trace records each request's size, not the block the allocator gave it: a request over 1 MiB takes
the whole free block it lands in unless more than 1 MiB would be left (PyTorch's c10/cuda/CUDACachingAllocator.cpp),
so a block can be up to 1 MiB larger, and ``max_memory_allocated`` counts blocks. :func:`replay` rebuilds each
block's size from where it was placed (the next block's address, or the end of its segment), checks the sizes
against the segments for every block alive at the end, and finds the peak; blocks made before the recording and
freed during it keep only their request, so their sizes are bounded, not known (``Replay.upper``). On three real
H200 snapshots (tests/fixtures/snapshots/h200, 2026-11-28) the rebuilt sizes agreed with the segments for every
block alive at the end, and the first snapshot's peak equals the allocator's ``max_memory_allocated``.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Iterator

from memlab.core.allocator_config import DEFAULT_CONFIG, SMALL_SIZE, AllocatorConfig, round_size

__all__ = ["ALLOCATED", "Block", "Replay", "Segments", "Sizer", "end_state", "frames_of", "replay"]


def frames_of(b: dict) -> list[dict]:
    """A block's or an event's stack frames (dicts), in either snapshot layout."""
    frames = b.get("frames")
    if frames is None and b.get("history"):  # the old layout: the first history entry holds them
        frames = b["history"][0].get("frames", [])
    return [f for f in (frames or []) if isinstance(f, dict)]


ALLOCATED = ("active_allocated", "active_pending_free")


def end_state(segments: list[dict]) -> dict[int, dict]:
    """Address -> block, for every allocated block as the snapshot was taken."""
    live = {}
    for seg in segments:
        addr = int(seg.get("address", 0))
        for b in seg["blocks"]:
            a = int(b.get("address", addr))
            if b["state"] in ALLOCATED:
                live[a] = b
            addr = a + int(b["size"])
    return live


def _rounding_config(div: Any) -> AllocatorConfig:
    # a snapshot's roundup_power2_divisions ({interval start in MiB: divisions}, every interval listed) as the
    # allocator config whose round_size it follows; intervals past the last listed one take its value; settings the
    # config refuses (not powers of two) leave plain 512-byte rounding
    if not isinstance(div, dict) or not div:
        return DEFAULT_CONFIG
    try:
        table = {int(k): int(v) for k, v in sorted(div.items(), key=lambda kv: int(kv[0]))}
        return AllocatorConfig(roundup_power2_divisions={**table, ">": table[max(table)]})
    except (TypeError, ValueError):
        return DEFAULT_CONFIG


class Sizer:
    """The block size PyTorch's caching allocator (c10/cuda/CUDACachingAllocator.cpp) gives a request, under the
    snapshot's ``allocator_settings`` (the defaults where it has none)."""

    def __init__(self, settings: Any):
        settings = settings if isinstance(settings, dict) else {}
        self.expandable = bool(settings.get("expandable_segments"))
        mss = settings.get("max_split_size", -1)
        self.max_split = mss if isinstance(mss, int) and 0 < mss < 2**62 else None
        self.config = _rounding_config(settings.get("roundup_power2_divisions"))

    def rounded(self, n: int) -> int:
        """round_size: up to 512 bytes, or to the next of ``roundup_power2_divisions`` steps where it is set."""
        return round_size(n, self.config)

    def placed(self, request: int, free: int | None) -> tuple[int, int]:
        """(least, most) size of the block for ``request`` placed at the start of a free block of ``free`` bytes
        (None: unknown): the rounded request, or the whole free block where the allocator does not split it."""
        r = self.rounded(request)
        if r <= SMALL_SIZE or self.expandable:  # the small pool, or expandable segments: a remainder of 512 B is split
            return r, r
        if free is None:
            return r, r + (SMALL_SIZE if self.max_split is None or r < self.max_split else 20 * SMALL_SIZE)
        if free < r:  # not a free block the request fits: the addresses disagree with the model
            return r, r
        if self.max_split is not None and r >= self.max_split:
            return free, free  # an oversize block is never split
        return (r, r) if free - r > SMALL_SIZE else (free, free)


@dataclass
class Block:
    """One block in the replay: its size (``size`` the least it can be, ``upper`` the most), what was requested, its
    alloc frames; ``before``: made before the recording began; ``freed_frames``: where such a block was freed."""

    addr: int
    size: int
    upper: int
    requested: int
    frames: list
    before: bool = False
    freed_frames: list = field(default_factory=list)


class Segments:
    """The segments' address ranges as the replay goes (start -> size), to find the end of a free block."""

    def __init__(self, ranges: dict[int, int]):
        self.ranges = dict(ranges)
        self._sorted()

    def _sorted(self) -> None:
        self.starts = sorted(self.ranges)

    def add(self, addr: int, size: int) -> None:
        self.ranges[addr] = size
        self._sorted()

    def drop(self, addr: int) -> None:
        if self.ranges.pop(addr, None) is not None:
            self._sorted()

    def next_start(self, addr: int, starts: list[int]) -> int | None:
        """Where the free space after a block at ``addr`` ends: the next block in ``starts`` (sorted) or the end of
        its segment; None outside every segment."""
        seg = self.of(addr)
        if seg is None:
            return None
        j = bisect.bisect_right(starts, addr)
        return min(starts[j], seg[1]) if j < len(starts) else seg[1]

    def of(self, addr: int) -> tuple[int, int] | None:
        i = bisect.bisect_right(self.starts, addr) - 1
        if i < 0:
            return None
        start = self.starts[i]
        return (start, start + self.ranges[start]) if addr < start + self.ranges[start] else None


_SEG_ADD, _SEG_DROP = ("segment_alloc", "segment_map"), ("segment_free", "segment_unmap")


@dataclass
class Replay:
    index: int  # the peak: the state after trace[:index]
    allocated: int  # at the peak, the blocks' least sizes
    upper: int  # the most the peak can be (the largest sum of the blocks' most sizes over the trace)
    reserved: int  # at the peak
    live: list  # the Block s counted at the peak
    uncertain: list  # blocks whose size the snapshot does not fix
    disagree: int  # blocks alive at the end whose modelled size is not the segments' (the segments' is used)
    modelled: int  # blocks alive at the end whose size was modelled (and checked)



def _start_blocks(segs: list[dict], trace: list[dict], sizer: Sizer | None
                  ) -> tuple[dict[int, Block], dict[int, int], dict[int, dict]]:
    """The blocks allocated as the recording began (address -> Block), the segments then (start -> size), and the
    allocated blocks as the snapshot was taken (address -> its dict)."""
    end = end_state(segs)
    ranges = {int(s.get("address", 0)): int(s["total_size"]) for s in segs}
    occupied, first_free = set(end), {}
    for ev in reversed(trace):  # the addresses in use, and the segments, as the recording began
        act, addr = ev.get("action"), ev.get("addr")
        if act == "alloc":
            occupied.discard(addr)
        elif act == "free_completed" and addr not in occupied:
            occupied.add(addr)
        elif act in _SEG_ADD:
            ranges.pop(addr, None)
        elif act in _SEG_DROP:
            ranges[addr] = int(ev.get("size", 0))
        if act in ("free_requested", "free_completed") and addr in occupied:
            first_free[addr] = ev  # the earliest free of the block there as the recording began
    segments, order = Segments(ranges), sorted(occupied)
    blocks: dict[int, Block] = {}
    for addr in order:
        ev = first_free.get(addr)
        if ev is None:  # alive from before the recording to its end: the segments give it
            b = end[addr]
            size = int(b["size"])
            blocks[addr] = Block(addr, size, size, int(b.get("requested_size", size)), frames_of(b), before=True)
            continue
        req = int(ev.get("size", 0))  # made before the recording, freed during it: only its request is left
        lo, hi = (req, req) if sizer is None else sizer.placed(req, None)
        nxt = segments.next_start(addr, order)
        if hi > lo and nxt is not None:
            hi = max(lo, min(hi, nxt - addr))
        blocks[addr] = Block(addr, lo, hi, req, [], before=True, freed_frames=frames_of(ev))
    return blocks, ranges, end


def _size_made(trace: list[dict], blocks: dict[int, Block], segments: Segments, sizer: Sizer | None
               ) -> list[Block | None]:
    """Each alloc event's block (None for other events), sized from where it was placed; a block placed right after
    another fixes that one's size. ``blocks`` ends as the blocks alive at the trace's end."""
    made: list[Block | None] = [None] * len(trace)
    starts = sorted(blocks)
    for i, ev in enumerate(trace):
        act, addr = ev.get("action"), ev.get("addr")
        if act == "alloc":
            req = int(ev.get("size", 0))
            if sizer is None:
                lo = hi = req
            else:
                seg = segments.of(addr)
                j = bisect.bisect_left(starts, addr)
                if seg is not None and j > 0 and starts[j - 1] >= seg[0]:
                    prev = blocks.get(starts[j - 1])
                    if prev is not None and prev.upper > prev.size and prev.size <= addr - prev.addr <= prev.upper:
                        prev.size = prev.upper = addr - prev.addr
                nxt = segments.next_start(addr, starts)
                lo, hi = sizer.placed(req, None if nxt is None else nxt - addr)
            b = Block(addr, lo, hi, req, frames_of(ev))
            if addr in blocks and addr in starts:  # an address in use taken again: the trace lost its free
                starts.remove(addr)
            bisect.insort(starts, addr)
            blocks[addr] = made[i] = b
        elif act == "free_completed" and addr in blocks:
            del blocks[addr]
            j = bisect.bisect_left(starts, addr)
            if j < len(starts) and starts[j] == addr:
                del starts[j]
        elif act in _SEG_ADD:
            segments.add(addr, int(ev.get("size", 0)))
        elif act in _SEG_DROP:
            segments.drop(addr)
    return made


def _walk(trace: list[dict], start: dict[int, Block], made: list[Block | None], stop: int | None = None
          ) -> Iterator[tuple[int, int, int, dict[int, Block]]]:
    """(events replayed, least allocated, most allocated, the blocks counted) after each event of ``trace[:stop]``;
    a block stops counting at its free request, as ``max_memory_allocated`` does."""
    live = dict(start)
    counted = set(live)
    lo = sum(b.size for b in live.values())
    hi = sum(b.upper for b in live.values())
    yield 0, lo, hi, live
    for i, ev in enumerate(trace[:stop]):
        act, addr = ev.get("action"), ev.get("addr")
        if act == "alloc" and made[i] is not None:
            if addr in counted:  # a lost free: the old block is gone
                lo -= live[addr].size
                hi -= live[addr].upper
            live[addr] = made[i]
            counted.add(addr)
            lo += made[i].size
            hi += made[i].upper
        elif act in ("free_requested", "free_completed") and addr in counted:
            counted.discard(addr)
            lo -= live[addr].size
            hi -= live[addr].upper
        if act == "free_completed":
            live.pop(addr, None)
        yield i + 1, lo, hi, {a: live[a] for a in counted} if stop is not None and i + 1 == stop else live


def replay(segs: list[dict], trace: list[dict], sizer: Sizer | None) -> Replay:
    """The allocator's allocated bytes through ``trace`` from the state the segments end in: the blocks' sizes
    rebuilt by ``sizer`` from the addresses (``None``: the events' sizes are the blocks', a memlab timeline)."""
    start, ranges, end = _start_blocks(segs, trace, sizer)
    blocks = dict(start)
    made = _size_made(trace, blocks, Segments(ranges), sizer)
    disagree = modelled = 0
    for addr, b in blocks.items():  # alive at the end: the segments know the size
        if not b.before and addr in end:
            modelled += 1
            true = int(end[addr]["size"])
            disagree += not (b.size <= true <= b.upper) or (b.size == b.upper != true)
            b.size = b.upper = true
            b.requested = int(end[addr].get("requested_size", b.requested))
    best, top = (0, -1), 0
    for idx, lo, hi, _ in _walk(trace, start, made):
        if lo > best[1]:
            best = (idx, lo)
        top = max(top, hi)
    index, allocated = best
    live_at = list(start.values())
    for idx, _, _, live in _walk(trace, start, made, index):
        if idx == index:
            live_at = list(live.values())
    reserved = sum(ranges.values())
    for ev in trace[:index]:
        if ev.get("action") in _SEG_ADD:
            reserved += int(ev.get("size", 0))
        elif ev.get("action") in _SEG_DROP:
            reserved -= int(ev.get("size", 0))
    uncertain = [b for b in list(start.values()) + [m for m in made if m is not None] if b.upper > b.size]
    return Replay(index, allocated, max(top, allocated), reserved, live_at, uncertain, disagree, modelled)
