"""A model of PyTorch's CUDA caching allocator: replay allocation and free events, predict reserved memory.

``torch.cuda.max_memory_allocated`` counts the blocks handed to tensors; ``max_memory_reserved`` counts the
segments the allocator took from the driver (``cudaMalloc`` or mapped pages), allocated or cached; nvidia-smi
adds the CUDA context. This module replays a sequence of allocations and frees (sizes and order, optionally a
stream each) through the allocator's rules and reports the peaks, so that a trace made on a CPU
(:mod:`memlab.estimate.trace`) predicts what a CUDA card reserves instead of a flat margin.

Rules modelled, written from PyTorch's ``c10/cuda/CUDACachingAllocator.cpp`` (torch 2.x, ``DeviceCachingAllocator``:
``round_size``, ``get_allocation_size``, ``get_free_block``, ``should_split``, ``alloc_found_block``,
``free_block``/``try_merge_blocks``, ``release_available_cached_blocks``, ``release_cached_blocks``,
``try_allocate_expandable_block``; the file's design notes, ``Block`` and ``ExpandableSegment`` read in the copy
rbarfinezhadfeli0/pytorch@0edb99975b52c06dad143830b29e971e066b1b4a, ``docs/c10/cuda/CUDACachingAllocator.cpp_docs.md``),
its config parser (``CUDAAllocatorConfig::parseRoundUpPower2Divisions``, ``c10/cuda/CUDAAllocatorConfig.cpp``) and
the "Memory management" section of PyTorch's CUDA semantics notes
(https://pytorch.org/docs/stable/notes/cuda.html, ``PYTORCH_CUDA_ALLOC_CONF``):

* every request is rounded up to a multiple of 512 bytes (``kMinBlockSize``), or with
  ``roundup_power2_divisions`` to the next of that many equal steps between two powers of two;
* requests of at most 1 MiB (``kSmallSize``) use the small pool, whose segments are 2 MiB (``kSmallBuffer``);
  larger ones the large pool, whose segment is 20 MiB (``kLargeBuffer``) below 10 MiB (``kMinLargeAlloc``)
  and the request rounded up to 2 MiB (``kRoundLarge``) from there;
* a request takes the smallest cached block of its pool and stream that fits (best fit, lowest address
  on a tie), else a new segment;
* a block is split when the remainder is at least 512 bytes (small pool, or expandable segments) or more
  than 1 MiB (large pool, and only for requests under ``max_split_size_mb``); an unsplit remainder counts
  as allocated, as the allocator's ``allocated_bytes`` counts the block;
* with ``max_split_size_mb``, a cached block at least that large serves no smaller request, and a request
  at least that large only a block less than ``max_non_split_rounding_mb`` (default 20 MiB) larger;
* a freed block merges with free neighbours of its segment;
* when the card is full (``capacity_bytes``): free cached oversize blocks (``max_split_size_mb`` set) and
  retry, then free every cached whole segment and retry, then out of memory;
* ``expandable_segments``: one segment per pool and stream, grown by mapping 2 MiB pages (small pool) or
  20 MiB pages (large pool) at its end; blocks split whenever 512 bytes remain; on a full card the free
  pages are unmapped.

Checked against the real allocator: :func:`memlab.estimate.allocator_replay.compare_snapshot` runs the model from the
state a CUDA memory snapshot implies at its recording's start through the snapshot's trace, following the real
segments' addresses (:meth:`CachingAllocatorModel.seed_segment`, ``malloc(..., segment_address=)``). On three traces
from an H200 (torch 2.11, default settings; tests/ch01/test_allocator_model_h200.py) it put every one of 1,825
blocks at the real address and opened the same 41 segments at the same allocations.

Not modelled: CUDA graphs' private pools, ``garbage_collection_threshold``, events of blocks used on other
streams (a block is reused as soon as it is freed), ``per_process_memory_fraction`` (give ``capacity_bytes``).
"""
from __future__ import annotations

import bisect
import itertools
from typing import Any

from memlab.core.units import MiB
from memlab.core.validation import check_bool, check_int, invalid
from memlab.core.allocator_config import (DEFAULT_CONFIG, LARGE_BUFFER, MIN_BLOCK, MIN_LARGE_ALLOC, NO_LIMIT,
                                          ROUND_LARGE, SMALL_BUFFER, SMALL_SIZE, AllocatorConfig, allocation_size,
                                          round_size)

__all__ = ["AllocatorConfig", "CachingAllocatorModel", "AllocatorOutOfMemory", "round_size", "allocation_size",
           "DEFAULT_CONFIG", "MIN_BLOCK", "SMALL_SIZE", "SMALL_BUFFER", "LARGE_BUFFER", "MIN_LARGE_ALLOC", "ROUND_LARGE"]

class AllocatorOutOfMemory(MemoryError):
    """A request the modelled card cannot hold even after freeing every cached block."""


class _Block:
    __slots__ = ("addr", "size", "small", "stream", "allocated", "mapped", "prev", "next", "seg")

    def __init__(self, addr: int, size: int, small: bool, stream: int, seg: Any) -> None:
        self.addr, self.size, self.small, self.stream, self.seg = addr, size, small, stream, seg
        self.allocated, self.mapped = False, True
        self.prev: _Block | None = None
        self.next: _Block | None = None

    def key(self) -> tuple[int, int, int]:
        return (self.stream, self.size, self.addr)


class _Expandable:
    """One expandable segment: its page size and its mapped bytes."""

    __slots__ = ("page", "mapped", "base")

    def __init__(self, page: int, base: int) -> None:
        self.page, self.mapped, self.base = page, 0, base


class CachingAllocatorModel:
    """The allocator's state: segments, blocks, the two pools of cached blocks and the statistics.

    ``malloc(nbytes, stream)`` returns a handle for ``free(handle)``. The statistics follow
    ``torch.cuda.memory_stats``: ``allocated`` (blocks handed out), ``reserved`` (segments or mapped
    pages), ``requested`` (bytes asked for), each with its ``max_``.

    Args:
        config: the ``PYTORCH_CUDA_ALLOC_CONF`` options (:class:`AllocatorConfig`).
        capacity_bytes: what the allocator may reserve (the card's memory less the CUDA context); None: no limit.
    """

    def __init__(self, config: AllocatorConfig | None = None, capacity_bytes: int | None = None) -> None:
        if config is not None and not isinstance(config, AllocatorConfig):
            raise invalid("config", config, "an AllocatorConfig or None")
        if capacity_bytes is not None:
            check_int("capacity_bytes", capacity_bytes, minimum=1)
        self.config = config or DEFAULT_CONFIG
        self.capacity = capacity_bytes
        self._free: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}  # sorted keys of cached blocks
        self._by_key: dict[tuple[int, int, int], _Block] = {}
        self._expandable: dict[tuple[bool, int], _Block] = {}  # (small, stream) -> the segment's first block
        self._live: dict[int, tuple[_Block, int]] = {}
        self._handles = itertools.count()
        self._next_addr = 0
        self._segs: dict[int, tuple[int, bool, int]] = {}  # a whole segment's address -> (size, small, stream)
        self.allocated = self.reserved = self.requested = 0
        self.max_allocated = self.max_reserved = self.max_requested = 0
        self.segments = 0  # segments taken from the driver (cudaMalloc calls; expandable: each grow)
        self.retries = 0  # full-card retries after freeing cached blocks

    # ---------------------------------------------------------------- the public operations
    def malloc(self, nbytes: int, stream: int = 0, *, segment_address: int | None = None) -> int:
        """Allocate ``nbytes`` (an int >= 0) on ``stream``; returns the handle to :meth:`free`.

        ``segment_address``: where the driver puts the segment if this request opens one (to follow a real trace's
        addresses, on which best fit's ties depend); None: a made-up address beyond every other.

        Raises:
            AllocatorOutOfMemory: the request does not fit ``capacity_bytes`` even after freeing the cache.
        """
        check_int("nbytes", nbytes, minimum=0)
        check_int("stream", stream, minimum=0)
        if segment_address is not None:
            check_int("segment_address", segment_address, minimum=0)
        if nbytes == 0:  # PyTorch hands out a null pointer: no block
            handle = next(self._handles)
            self._live[handle] = (None, 0)  # type: ignore[assignment]
            return handle
        size = round_size(nbytes, self.config)
        small = size <= SMALL_SIZE
        block = self._get_free_block(small, size, stream)
        if block is None:
            block = self._new_block(small, size, stream, segment_address)
        if block is None:
            self.retries += 1
            if self._release_oversize(small, size, stream):
                block = self._new_block(small, size, stream, segment_address)
            if block is None:
                self.release_cached()
                block = self._new_block(small, size, stream, segment_address)
        if block is None:
            raise AllocatorOutOfMemory(
                f"modelled out of memory: {nbytes:,} B requested with {self.reserved:,} B reserved "
                f"({self.allocated:,} B allocated) of capacity_bytes={self.capacity:,}")
        block = self._split(block, size)
        block.allocated = True
        self.allocated += block.size
        self.requested += nbytes
        self.max_allocated = max(self.max_allocated, self.allocated)
        self.max_requested = max(self.max_requested, self.requested)
        handle = next(self._handles)
        self._live[handle] = (block, nbytes)
        return handle

    def free(self, handle: int) -> None:
        """Give back the block of ``handle``: it is cached, merged with free neighbours.

        Raises:
            ValueError: a handle that is not live.
        """
        if handle not in self._live:
            raise invalid("handle", handle, "a live handle returned by malloc")
        block, nbytes = self._live.pop(handle)
        if block is None:
            return
        block.allocated = False
        self.allocated -= block.size
        self.requested -= nbytes
        for other in (block.prev, block.next):
            if other is not None and not other.allocated and other.mapped == block.mapped:
                self._take(other)
                if other is block.prev:
                    block.addr, block.prev = other.addr, other.prev
                    if other.prev is not None:
                        other.prev.next = block
                else:
                    block.next = other.next
                    if other.next is not None:
                        other.next.prev = block
                block.size += other.size
        if block.prev is None and isinstance(block.seg, _Expandable):
            self._expandable[(block.small, block.stream)] = block
        self._put(block)

    def release_cached(self) -> int:
        """``torch.cuda.empty_cache()``: give every cached whole segment back (expandable: unmap the free
        pages); returns the bytes released."""
        before = self.reserved
        for small in (True, False):
            for key in list(self._free[small]):
                b = self._by_key.get(key)
                if b is None:
                    continue
                if isinstance(b.seg, _Expandable):
                    self._unmap(b)
                elif b.prev is None and b.next is None:
                    self._take(b)
                    self._segs.pop(b.addr, None)
                    self.reserved -= b.size
        return before - self.reserved

    def seed_segment(self, address: int, size: int, small: bool, live: Any = (), stream: int = 0) -> list[int]:
        """Add a segment the allocator held before the replay starts (as a snapshot shows it), with the blocks
        ``live`` in it: ``(address, block_size, requested_bytes)`` each, in address order; the rest is cached,
        one free block per gap. Returns a handle per live block. The segment counts in ``reserved``, its blocks in
        ``allocated``, the maxima follow (as after ``torch.cuda.reset_peak_memory_stats``); ``segments`` counts
        driver calls made during the replay only.

        Raises:
            ValueError: a size that is not a positive multiple of 512, a segment that overlaps one held, blocks
                outside the segment or overlapping, or an expandable-segments config.
        """
        if self.config.expandable_segments:
            raise invalid("config", self.config.describe(), "fixed segments (seed_segment does not model "
                                                            "expandable segments)")
        check_int("address", address, minimum=0)
        check_int("size", size, minimum=MIN_BLOCK)
        check_bool("small", small)
        check_int("stream", stream, minimum=0)
        if size % MIN_BLOCK:
            raise invalid("size", size, "a multiple of 512 bytes")
        for a, (n, _, _) in self._segs.items():
            if a < address + size and address < a + n:
                raise invalid("address", address, f"a segment clear of those held (one is {a:#x}, {n:,} B)")
        blocks: list[_Block] = []
        handles: list[int] = []
        at = address
        for item in live:
            if not (isinstance(item, tuple) and len(item) == 3):
                raise invalid("live", item, "(address, block_size, requested_bytes) tuples")
            a, n, req = item
            check_int("live block address", a, minimum=at)
            check_int("live block size", n, minimum=MIN_BLOCK)
            check_int("live block requested bytes", req, minimum=0)
            if n % MIN_BLOCK or a + n > address + size:
                raise invalid("live", item, f"a block of 512-byte multiples inside [{address:#x}, "
                                            f"{address + size:#x})")
            if a > at:
                blocks.append(_Block(at, a - at, small, stream, None))
            b = _Block(a, n, small, stream, None)
            b.allocated = True
            blocks.append(b)
            handles.append(next(self._handles))
            self._live[handles[-1]] = (b, req)
            self.allocated += n
            self.requested += req
            at = a + n
        if at < address + size:
            blocks.append(_Block(at, address + size - at, small, stream, None))
        for p, n in zip(blocks, blocks[1:]):
            p.next, n.prev = n, p
        for b in blocks:
            if not b.allocated:
                self._put(b)
        self._segs[address] = (size, small, stream)
        self._next_addr = max(self._next_addr, address + size + (1 << 40))
        self.reserved += size
        self.max_reserved = max(self.max_reserved, self.reserved)
        self.max_allocated = max(self.max_allocated, self.allocated)
        self.max_requested = max(self.max_requested, self.requested)
        return handles

    def address(self, handle: int) -> int | None:
        """The address of ``handle``'s block (None for a zero-byte request)."""
        if handle not in self._live:
            raise invalid("handle", handle, "a live handle returned by malloc or seed_segment")
        block = self._live[handle][0]
        return None if block is None else block.addr

    def segment_layout(self) -> list[tuple[int, int, bool]]:
        """The fixed segments held: ``(address, size, small)`` each, in address order (expandable segments are not
        listed)."""
        return sorted((a, n, small) for a, (n, small, _) in self._segs.items())

    def block_layout(self) -> list[tuple[int, int, bool]]:
        """The blocks of the fixed segments: ``(address, size, allocated)`` each, in address order."""
        blocks = [b for b, _ in self._live.values() if b is not None] + list(self._by_key.values())
        return sorted((b.addr, b.size, b.allocated) for b in blocks if not isinstance(b.seg, _Expandable))

    @property
    def live_blocks(self) -> int:
        """How many allocations are live."""
        return len(self._live)

    # ---------------------------------------------------------------- pools
    def _put(self, b: _Block) -> None:
        k = b.key()
        bisect.insort(self._free[b.small], k)
        self._by_key[k] = b

    def _take(self, b: _Block) -> None:
        k = b.key()
        keys = self._free[b.small]
        i = bisect.bisect_left(keys, k)
        if i < len(keys) and keys[i] == k:
            del keys[i]
            del self._by_key[k]

    def _get_free_block(self, small: bool, size: int, stream: int) -> _Block | None:
        # get_free_block: the smallest cached block of the pool and stream that fits, unless an oversize rule bars it
        keys = self._free[small]
        i = bisect.bisect_left(keys, (stream, size, -1))
        if i == len(keys) or keys[i][0] != stream:
            return None
        b = self._by_key[keys[i]]
        if not b.mapped:
            return None
        limit = self.config.max_split_bytes
        if size < limit <= b.size:
            return None  # an oversize block serves no small request
        if size >= limit and b.size >= size + int(self.config.max_non_split_rounding_mb * MiB):
            return None  # nor a large request much smaller than itself
        self._take(b)
        return b

    def _should_split(self, b: _Block, size: int) -> bool:
        remaining = b.size - size
        if b.small or isinstance(b.seg, _Expandable):
            return remaining >= MIN_BLOCK
        return size < self.config.max_split_bytes and remaining > SMALL_SIZE

    def _split(self, b: _Block, size: int) -> _Block:
        if not self._should_split(b, size):
            return b
        rest = _Block(b.addr + size, b.size - size, b.small, b.stream, b.seg)
        rest.prev, rest.next = b, b.next
        if b.next is not None:
            b.next.prev = rest
        b.next, b.size = rest, size
        self._put(rest)
        return b

    # ---------------------------------------------------------------- new memory
    def _fits(self, nbytes: int) -> bool:
        return self.capacity is None or self.reserved + nbytes <= self.capacity

    def _grow(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.segments += 1
        self.max_reserved = max(self.max_reserved, self.reserved)

    def _new_block(self, small: bool, size: int, stream: int, address: int | None = None) -> _Block | None:
        if self.config.expandable_segments:
            return self._expand(small, size, stream)
        seg_size = allocation_size(size)
        if not self._fits(seg_size):
            return None
        self._grow(seg_size)
        if address is None:
            address = self._next_addr
        b = _Block(address, seg_size, small, stream, None)
        self._segs[address] = (seg_size, small, stream)
        self._next_addr = max(self._next_addr, address + seg_size + (1 << 40))  # made-up segments never touch
        return b

    def _expand(self, small: bool, size: int, stream: int) -> _Block | None:
        # try_allocate_expandable_block: map pages where the segment's free tail (and its unmapped space) holds size
        first = self._expandable.get((small, stream))
        if first is None:
            seg = _Expandable(SMALL_BUFFER if small else LARGE_BUFFER, self._next_addr)
            first = _Block(self._next_addr, 1 << 60, small, stream, seg)
            first.mapped = False
            self._next_addr += (1 << 61)
            self._expandable[(small, stream)] = first
        seg = first.seg
        b: _Block | None = first
        while b is not None:  # the lowest unmapped block with room, a free mapped block before it included
            if not b.mapped:
                start = b.prev if (b.prev is not None and not b.prev.allocated and b.prev.mapped) else b
                if (start.size if start is not b else 0) + b.size >= size:
                    break
            b = b.next
        if b is None:
            return None
        have = start.size if start.mapped else 0
        need = -(-(size - have) // seg.page) * seg.page
        if not self._fits(need):
            return None
        self._grow(need)
        seg.mapped += need
        return self._map_front(start, b, need)

    def _map_front(self, start: _Block, unmapped: _Block, need: int) -> _Block:
        # map `need` bytes at the front of `unmapped`; merge them into the free mapped block `start` before it
        if unmapped.size > need:
            rest = _Block(unmapped.addr + need, unmapped.size - need, unmapped.small, unmapped.stream, unmapped.seg)
            rest.mapped = False
            rest.prev, rest.next = unmapped, unmapped.next
            if unmapped.next is not None:
                unmapped.next.prev = rest
            unmapped.next, unmapped.size = rest, need
        unmapped.mapped = True
        if start is unmapped:
            return unmapped
        self._take(start)
        start.size += unmapped.size
        start.next = unmapped.next
        if unmapped.next is not None:
            unmapped.next.prev = start
        return start

    def _unmap(self, b: _Block) -> None:
        # unmap_block: the whole pages inside a free block of an expandable segment
        page, base = b.seg.page, b.seg.base
        lo = base + -(-(b.addr - base) // page) * page
        hi = base + (b.addr + b.size - base) // page * page
        if hi <= lo:
            return
        self._take(b)
        self.reserved -= hi - lo
        b.seg.mapped -= hi - lo
        parts = [(b.addr, lo - b.addr, True), (lo, hi - lo, False), (hi, b.addr + b.size - hi, True)]
        prev, after = b.prev, b.next
        for addr, size, mapped in parts:
            if size == 0:
                continue
            nb = _Block(addr, size, b.small, b.stream, b.seg)
            nb.mapped = mapped
            nb.prev = prev
            if prev is not None:
                prev.next = nb
            prev = nb
            if mapped:
                self._put(nb)
        prev.next = after
        if after is not None:
            after.prev = prev
        c: _Block | None = self._first(prev)
        self._expandable[(b.small, b.stream)] = c  # type: ignore[assignment]
        while c is not None and c.next is not None:  # neighbouring unmapped ranges become one
            if not c.mapped and not c.next.mapped:
                nxt = c.next
                c.size += nxt.size
                c.next = nxt.next
                if nxt.next is not None:
                    nxt.next.prev = c
            else:
                c = c.next

    @staticmethod
    def _first(b: _Block) -> _Block:
        while b.prev is not None:
            b = b.prev
        return b

    def _release_oversize(self, small: bool, size: int, stream: int) -> bool:
        # release_available_cached_blocks: with max_split_size set, free one cached oversize segment that covers the
        # request, else the largest ones until enough is freed
        limit = self.config.max_split_bytes
        if limit == NO_LIMIT:
            return False
        want = max(size, limit)
        keys = [k for k in self._free[small] if k[0] == stream and k[1] >= limit]
        whole = [self._by_key[k] for k in keys if self._by_key[k].prev is None and self._by_key[k].next is None
                 and not isinstance(self._by_key[k].seg, _Expandable)]
        fit = [b for b in whole if b.size >= want]
        chosen = fit[:1] if fit else []
        total = 0
        if not chosen:  # the largest first, released as they are counted (even when they do not add up)
            for b in reversed(whole):
                if total >= want:
                    break
                chosen.append(b)
                total += b.size
        for b in chosen:
            self._take(b)
            self._segs.pop(b.addr, None)
            self.reserved -= b.size
        return bool(fit) or total >= want
