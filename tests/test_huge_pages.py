"""The huge-page policy for the memory peers move (mpigrad._base.huge_pages): which
regions are collapsed, when, how much of them, and that a real collapse keeps the
contents."""

import mmap
import os
import sys

import numpy as np
import pytest

from mpigrad._base import huge_pages
from mpigrad._base.huge_pages import (BUDGET_SECONDS, HUGE_PAGE, MIN_BYTES, PIECE_BYTES,
                                      SEEN_CALLS, Collapser)


def recording():
    calls = []
    return calls, Collapser(lambda start, length: calls.append((start, length)) or 0)


def test_a_region_is_collapsed_once_at_its_third_call_over_its_whole_huge_pages():
    calls, collapser = recording()
    address, nbytes = 5 * HUGE_PAGE + 4096, 3 * HUGE_PAGE
    for _ in range(SEEN_CALLS - 1):
        collapser.advise(address, nbytes)
    assert calls == []
    collapser.advise(address, nbytes)
    assert calls == [(6 * HUGE_PAGE, 2 * HUGE_PAGE)]      # [6, 8) of [5 + 1/512, 8 + 1/512)
    for _ in range(5):
        collapser.advise(address, nbytes)
    assert len(calls) == 1


def test_memory_made_anew_where_pages_were_collapsed_is_not_collapsed_again():
    # torch's gradients under zero_grad(set_to_none=True): a new tensor each step, its
    # data a few bytes off the last one's, on the same huge pages
    calls, collapser = recording()
    first = 5 * HUGE_PAGE + 64
    for address in (first, first + 4096, first + 8192):
        for _ in range(SEEN_CALLS):
            collapser.advise(address, 3 * HUGE_PAGE)
    assert calls == [(6 * HUGE_PAGE, 2 * HUGE_PAGE)]
    for _ in range(SEEN_CALLS):                # a page before them: that page alone
        collapser.advise(5 * HUGE_PAGE, 3 * HUGE_PAGE)
    for _ in range(SEEN_CALLS):                # elsewhere: all of it
        collapser.advise(20 * HUGE_PAGE, 3 * HUGE_PAGE)
    assert calls[1:] == [(5 * HUGE_PAGE, HUGE_PAGE), (20 * HUGE_PAGE, 3 * HUGE_PAGE)]


def test_small_regions_and_new_sizes_are_counted_apart():
    calls, collapser = recording()
    for _ in range(SEEN_CALLS + 2):
        collapser.advise(0, MIN_BYTES - 1)                  # below the floor: never
    assert calls == []
    for nbytes in (MIN_BYTES, MIN_BYTES + HUGE_PAGE):       # same address, another size
        for _ in range(SEEN_CALLS):
            collapser.advise(HUGE_PAGE, nbytes)
    # the larger one's pages that the smaller one's collapse left
    assert calls == [(HUGE_PAGE, MIN_BYTES), (HUGE_PAGE + MIN_BYTES, HUGE_PAGE)]


def test_the_budget_ends_every_later_collapse(monkeypatch):
    calls, collapser = recording()
    collapser.spent = BUDGET_SECONDS
    for _ in range(SEEN_CALLS):
        collapser.advise(0, MIN_BYTES)
    assert calls == []


def test_a_large_region_goes_a_piece_at_a_time_while_the_budget_lasts():
    calls = []

    def slow(start, length):
        calls.append((start, length))
        collapser.spent += BUDGET_SECONDS / 2.5             # as if each piece took that long
        return 0
    collapser = Collapser(slow)
    for _ in range(SEEN_CALLS):
        collapser.advise(0, 10 * PIECE_BYTES)
    assert calls == [(k * PIECE_BYTES, PIECE_BYTES) for k in range(3)]


def test_in_the_background_a_collapse_never_holds_up_the_call_that_asks_for_it():
    """This process's collapser: the third call returns while the collapse runs (a
    call that waited would hold its peers up); a region asked for meanwhile is taken
    by the same thread; the thread ends when none is left."""
    import threading
    calls, release = [], threading.Event()

    def slow(start, length):
        release.wait(60)
        calls.append((start, length))
        return 0
    collapser = Collapser(slow, background=True)
    for nbytes in (MIN_BYTES, 2 * MIN_BYTES):
        for _ in range(SEEN_CALLS):
            collapser.advise(0, nbytes)          # returns: the collapse waits on release
    assert calls == [] and collapser.worker is not None
    release.set()
    collapser.settle()
    assert calls == [(0, MIN_BYTES), (MIN_BYTES, MIN_BYTES)] and collapser.worker is None
    for _ in range(SEEN_CALLS):                 # a later region: a new thread
        collapser.advise(4 * MIN_BYTES, MIN_BYTES)
    collapser.settle()
    assert calls[-1] == (4 * MIN_BYTES, MIN_BYTES) and collapser.worker is None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_makes_its_own_collapser(monkeypatch):
    """A child forked while the thread holds the lock (a DataLoader's worker) would
    wait on it for ever: it starts from none."""
    parent = Collapser(lambda start, length: 0, background=True)
    monkeypatch.setattr(huge_pages, "_COLLAPSER", parent)
    with parent.lock:
        child = os.fork()
        if child == 0:                                    # the child: report and leave
            os._exit(0 if huge_pages._COLLAPSER is None else 1)
    assert os.waitpid(child, 0)[1] == 0
    assert huge_pages._COLLAPSER is parent


def test_without_madvise_nothing_happens_and_the_variable_turns_it_off(monkeypatch):
    Collapser(None).advise(0, MIN_BYTES)                    # no error, nothing to do
    monkeypatch.setenv("MPIGRAD_HUGE_PAGES", "0")
    assert huge_pages._libc_madvise() is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's madvise")
def test_a_real_collapse_keeps_every_byte(monkeypatch):
    monkeypatch.delenv("MPIGRAD_HUGE_PAGES", raising=False)
    madvise = huge_pages._libc_madvise()
    assert madvise is not None
    memory = mmap.mmap(-1, 4 * HUGE_PAGE)
    data = np.frombuffer(memory, np.uint8)
    data[...] = np.random.default_rng(0).integers(0, 256, data.size, dtype=np.uint8)
    before = data.copy()
    start = data.ctypes.data
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    error = madvise(first, HUGE_PAGE)                       # 0, or the kernel's refusal
    assert isinstance(error, int)
    np.testing.assert_array_equal(data, before)
    del data
    memory.close()


def _vm_flags(address):
    """The VmFlags of the mapping of this process that holds ``address``."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= address < high
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux's smaps")
def test_fresh_memory_about_to_be_filled_faults_huge_pages_in_and_memory_in_use_is_left(
        monkeypatch):
    monkeypatch.delenv("MPIGRAD_HUGE_PAGES", raising=False)
    monkeypatch.setattr(huge_pages, "_FAULTS", [])
    probe = mmap.mmap(-1, 2 * HUGE_PAGE)
    probe_at = np.frombuffer(probe, np.uint8).ctypes.data
    if huge_pages._libc_madvise(huge_pages.MADV_HUGEPAGE)(
            -(-probe_at // HUGE_PAGE) * HUGE_PAGE, 0) != 0:
        pytest.skip("this kernel has no transparent huge pages")
    fresh, used = mmap.mmap(-1, 5 * HUGE_PAGE), mmap.mmap(-1, 5 * HUGE_PAGE)
    fresh_at, used_at = (np.frombuffer(m, np.uint8).ctypes.data for m in (fresh, used))
    np.frombuffer(used, np.uint8)[...] = 1                  # every page in memory
    for start in (fresh_at, used_at):
        huge_pages.prefer_huge_faults(start, 5 * HUGE_PAGE)
    inner = -(-fresh_at // HUGE_PAGE) * HUGE_PAGE           # its whole huge pages only
    assert "hg" in _vm_flags(inner) and "hg" not in _vm_flags(used_at)
    if inner > fresh_at:
        assert "hg" not in _vm_flags(fresh_at)
    small = mmap.mmap(-1, MIN_BYTES - 4096)                   # too small to ask for
    small_at = np.frombuffer(small, np.uint8).ctypes.data
    huge_pages.prefer_huge_faults(small_at, MIN_BYTES - 4096)
    assert "hg" not in _vm_flags(small_at)
    monkeypatch.setenv("MPIGRAD_HUGE_PAGES", "0")             # off: nothing asked
    monkeypatch.setattr(huge_pages, "_FAULTS", [])
    other = mmap.mmap(-1, 5 * HUGE_PAGE)
    other_at = np.frombuffer(other, np.uint8).ctypes.data
    huge_pages.prefer_huge_faults(other_at, 5 * HUGE_PAGE)
    assert "hg" not in _vm_flags(-(-other_at // HUGE_PAGE) * HUGE_PAGE)
