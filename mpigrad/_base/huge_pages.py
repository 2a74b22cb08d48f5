"""Huge pages under the long-lived memory that peers move by cross-memory attach.

``process_vm_readv``/``writev`` pin and walk the other process's pages one at a time:
on 4 KiB pages (torch's CPU tensors: its allocator asks for no huge ones) an in-place
sum of a 100 MB tensor at 2 ranks took 18.7-19.0 ms here, against 13.4-14.0 ms for
the same tensor on 2 MiB pages, as numpy's own arrays of 4 MiB or more are. Linux
6.1's ``MADV_COLLAPSE`` moves a range onto huge pages in place, its contents as they
were. It is not free (40-700 ms for 100 MB the first time: the kernel compacts
memory to find the pages), so it is spent only on memory that lasts: a region of
``MIN_BYTES`` or more met at the same address and size in ``SEEN_CALLS`` calls, once
per region, at most ``BUDGET_SECONDS`` in all per process (checked between pieces of
``PIECE_BYTES``). This process's collapses run on a thread of their own, beside the
calls: a call that waited for one would hold its peers up too (an FSDP2 step's
transient buffers, 16 MB each, took 80 ms a collapse, the steps 300 ms -> 0.6-1.5 s
until the budget was spent). A reduce-scatter's and an all-gather's memory is not
counted (``CrossMemory.table(lasting=False)``): FSDP2 allocates it anew each step,
mostly at the address the last buffer of its size freed, so the count took it for
memory that lasts, and its collapses (30-50 ms each, 2 s a process) slowed FSDP2's
steps by a fifth. Nor is a huge page collapsed twice: memory met three times where
memory was collapsed before was freed and made anew there (torch's gradients under
``zero_grad(set_to_none=True)``: the same 16 MB ranges were collapsed again every few
steps, 4-68 ms each, 11-29 collapses in 60 steps of four such layers against 4-7), and
its pages would not last either; only a region's pages not collapsed yet are.
Failures are the kernel's refusal (an old kernel, memory it cannot collapse, memory
freed meanwhile) and change nothing.
``MPIGRAD_HUGE_PAGES=0`` turns it off."""

import ctypes
import os
import sys
import threading
import time
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Tuple

from .libc import LIBC

__all__ = ["Collapser", "advise", "prefer_huge_faults"]

#: Linux's MADV_COLLAPSE (6.1 and later; older kernels answer EINVAL)
MADV_COLLAPSE = 25
#: Linux's MADV_HUGEPAGE: the range's later page faults may take whole huge pages
MADV_HUGEPAGE = 14
HUGE_PAGE = 1 << 21
MIN_BYTES = 4 << 20
SEEN_CALLS = 3
BUDGET_SECONDS = 2.0
#: collapsed per madvise call (the budget is checked between them)
PIECE_BYTES = 64 << 20
#: regions remembered before the count starts over (the budget still bounds the cost)
_KEPT = 4096

Madvise = Callable[[int, int], int]


class Collapser:
    """The policy (see the module) over ``madvise(start, length) -> 0 or errno`` (the
    policy does not look at the answer: a refused region is not tried again); with
    ``background``, the collapses run on a thread of their own (``settle`` waits for
    them), else in the call that asks for them."""

    def __init__(self, madvise: Optional[Madvise], background: bool = False) -> None:
        self.madvise = madvise
        self.background = background
        self.seen: Dict[Tuple[int, int], int] = {}
        self.collapsed: List[Tuple[int, int]] = []         # [start, stop) collapsed once
        self.spent = 0.0            # seconds inside madvise
        self.lock = threading.Lock()
        self.pending: Deque[Tuple[int, int]] = deque()     # [start, stop) to collapse
        self.worker: Optional[threading.Thread] = None     # while it has pending regions

    def advise(self, address: int, nbytes: int) -> None:
        """Count one call's use of [address, address + nbytes); collapse its
        whole huge pages at the ``SEEN_CALLS``-th."""
        if self.madvise is None or nbytes < MIN_BYTES:
            return
        key = (address, nbytes)
        with self.lock:
            count = self.seen.get(key, 0) + 1
            if count > SEEN_CALLS or self.spent >= BUDGET_SECONDS:
                return                              # done with it (or with all)
            if len(self.seen) >= _KEPT:
                self.seen.clear()
            self.seen[key] = count
            if count < SEEN_CALLS:
                return
            pieces = _uncovered(*_whole_huge_pages(address, nbytes), self.collapsed)
            if not pieces:
                return                  # made anew where memory was collapsed: transient
            if len(self.collapsed) >= _KEPT:
                self.collapsed.clear()
            self.collapsed.extend(pieces)
            self.pending.extend(pieces)
            if self.background:
                if self.worker is None:
                    self.worker = threading.Thread(target=self.collapse_pending, daemon=True,
                                                   name="mpigrad huge pages")
                    self.worker.start()
                return
        self.collapse_pending()

    def collapse_pending(self) -> None:
        """Collapse the pending regions, a piece at a time while the budget lasts (the
        budget also bounds one very large region); the rest are dropped."""
        assert self.madvise is not None
        while True:
            with self.lock:
                if not self.pending or self.spent >= BUDGET_SECONDS:
                    self.pending.clear()
                    self.worker = None
                    return
                start, stop = self.pending.popleft()
            while start < stop and self.spent < BUDGET_SECONDS:
                length = min(PIECE_BYTES, stop - start)
                began = time.perf_counter()
                self.madvise(start, length)
                self.spent += time.perf_counter() - began
                start += length

    def settle(self, timeout: float = 60.0) -> None:
        """Wait until no collapse is pending (or ``timeout`` seconds)."""
        worker = self.worker
        if worker is not None:
            worker.join(timeout)


def _whole_huge_pages(address: int, nbytes: int) -> Tuple[int, int]:
    """[start, stop) of the huge pages wholly inside [address, address + nbytes)
    (start >= stop: none)."""
    return -(-address // HUGE_PAGE) * HUGE_PAGE, (address + nbytes) // HUGE_PAGE * HUGE_PAGE


def _uncovered(start: int, stop: int, covered: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """The parts of [start, stop) outside every range of ``covered``."""
    pieces = [(start, stop)] if start < stop else []
    for low, high in covered:
        pieces = [(a, b) for lo, hi in pieces
                  for a, b in ((lo, min(hi, low)), (max(lo, high), hi)) if a < b]
    return pieces


def _libc_madvise(advice: int = MADV_COLLAPSE) -> Optional[Madvise]:
    """libc's madvise with ``advice``, on Linux; None elsewhere or where off."""
    if not sys.platform.startswith("linux") or os.environ.get("MPIGRAD_HUGE_PAGES") == "0":
        return None
    call = getattr(LIBC, "madvise", None)
    if call is None:
        return None
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    call.restype = ctypes.c_int

    def madvise(start: int, length: int) -> int:
        return 0 if call(start, length, advice) == 0 else ctypes.get_errno()
    return madvise


def _libc_mincore() -> Optional[Callable[[int], bool]]:
    """Whether the page at an address (page-aligned) is in memory, by libc's mincore;
    None where it cannot be asked."""
    call = getattr(LIBC, "mincore", None)
    if call is None:
        return None
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    call.restype = ctypes.c_int
    page = os.sysconf("SC_PAGE_SIZE")

    def resident(address: int) -> bool:
        vector = ctypes.c_ubyte()
        return call(address, page, ctypes.byref(vector)) == 0 and bool(vector.value & 1)
    return resident


_FAULTS: List[Optional[Tuple[Madvise, Callable[[int], bool]]]] = []


def prefer_huge_faults(address: int, nbytes: int) -> None:
    """Let the first writes into [address, address + nbytes), memory a call is about to
    fill (a reduce-scatter's shard, an all-gather's output), fault whole huge pages in
    (MADV_HUGEPAGE on its whole huge pages): FSDP2 allocates both anew each step, and
    each 4 KiB page's first write cost a fault (a 51 MB shard: 12 500 faults, 25 ms of
    its 37 ms reduce-scatter at 2 ranks; 51 MB written fresh here, 34 ms, 7.9 ms with the
    advice). Only where the first page of its first or last huge page is not in memory yet (memory in
    use keeps its pages, and its mapping is not split up call after call); nothing under
    MIN_BYTES or with MPIGRAD_HUGE_PAGES=0."""
    if nbytes < MIN_BYTES:
        return
    if not _FAULTS:
        madvise, resident = _libc_madvise(MADV_HUGEPAGE), _libc_mincore()
        _FAULTS.append(None if madvise is None or resident is None else (madvise, resident))
    calls = _FAULTS[0]
    start, stop = _whole_huge_pages(address, nbytes)
    if calls is None or stop <= start:
        return
    madvise, resident = calls
    if not (resident(start) and resident(stop - HUGE_PAGE)):
        madvise(start, stop - start)


_COLLAPSER: Optional[Collapser] = None


def advise(address: int, nbytes: int) -> None:
    """This process's Collapser (made at first use) counts the region."""
    global _COLLAPSER
    if _COLLAPSER is None:
        _COLLAPSER = Collapser(_libc_madvise(), background=True)
    _COLLAPSER.advise(address, nbytes)


def _forget_in_child() -> None:
    """A forked child has no collapsing thread (and its lock may be held): its own, new."""
    global _COLLAPSER
    _COLLAPSER = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
