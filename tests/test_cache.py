"""Serial tests of the plan cache: hits, misses, byte-bounded eviction (no MPI)."""

import numpy as np
import pytest

from mpigrad._engine.cache import PlanCache
from mpigrad._engine.plan import DENSE, GradSpec
from mpigrad._base.settings import Settings


def specs(n, elements, dtype=np.float32):
    return tuple(GradSpec(DENSE, (elements,), np.dtype(dtype)) for _ in range(n))


def test_same_specs_hit_and_others_miss():
    cache = PlanCache(Settings())
    first = cache.get(specs(2, 10))
    assert cache.get(specs(2, 10)) is first
    assert cache.get(specs(3, 10)) is not first
    assert len(cache) == 2 and cache.nbytes == (20 + 30) * 4


def test_lookup_validates_on_a_miss_and_reuses_the_entry():
    cache = PlanCache(Settings())
    grads = [np.zeros(3, np.float32), np.zeros((2, 2), np.float16)]
    entry = cache.lookup(grads)
    assert cache.lookup([np.ones(3, np.float32), np.ones((2, 2), np.float16)]) is entry
    assert entry.plan.count == 2 and len(cache) == 1
    with pytest.raises(TypeError, match=r"grads\[1\]: expecting an array, got list"):
        cache.lookup([grads[0], [1.0]])
    with pytest.raises(TypeError, match=r"grads\[0\].*int32"):
        cache.lookup([np.zeros(3, np.int32)])


def test_eviction_is_bounded_by_bytes_least_recently_used_first():
    cache = PlanCache(Settings(), limit_bytes=1000)       # 2 entries of 400 bytes fit
    a = cache.lookup([np.zeros(100, np.float32)])
    b = cache.get(specs(2, 25, np.float64))
    assert cache.get(specs(1, 100)) is a                  # a is now the most recent
    c = cache.get(specs(4, 25))                           # evicts b, not a
    assert len(cache) == 2 and cache.nbytes == 800
    assert cache.get(specs(1, 100)) is a and cache.lookup([np.ones(100, np.float32)]) is a
    assert cache.get(specs(4, 25)) is c
    assert cache.get(specs(2, 25, np.float64)) is not b   # b was planned again


def test_an_entry_over_the_limit_is_still_kept_while_in_use():
    cache = PlanCache(Settings(), limit_bytes=10)
    big = cache.get(specs(1, 1000))
    assert cache.get(specs(1, 1000)) is big and len(cache) == 1


def test_fingerprint_records_the_settings():
    one = PlanCache(Settings(mean=True)).get(specs(1, 4))
    other = PlanCache(Settings(mean=False)).get(specs(1, 4))
    assert one.fingerprint != other.fingerprint


class _NodeMemory:
    """Stands for a SharedBuckets: every local rank's segment mapped here."""

    def __init__(self, local_ranks, arena_bytes):
        self.mapped_bytes = local_ranks * arena_bytes

    def allocate(self, sizes):
        return {dtype: np.zeros(n, dtype) for dtype, n in sizes.items()}


def test_node_memory_counts_every_mapped_segment_against_the_bound():
    cache = PlanCache(Settings(), limit_bytes=1000)
    a = cache.get(specs(1, 100))                          # 400 bytes
    cache.move_to_shared(a, _NodeMemory(2, 400))          # 800 mapped
    assert cache.nbytes == 800
    b = cache.get(specs(1, 50))                           # 200 bytes: 1000 in all
    assert len(cache) == 2
    cache.move_to_shared(b, _NodeMemory(2, 200))          # 1200: a goes
    assert len(cache) == 1 and cache.nbytes == 400
    assert cache.get(specs(1, 50)) is b
