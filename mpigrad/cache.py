"""Plans and bucket buffers per gradient signature (no MPI), bounded by the
bytes their buffers hold: least recently used signatures go first, and the one
in use is always kept."""

from collections import OrderedDict

from .buffers import BucketBuffers
from .check import describe, fingerprint
from .plan import SPARSE, make_plan

__all__ = ["Planned", "PlanCache", "DEFAULT_CACHE_BYTES"]

#: Bucket-buffer bytes the cache keeps across signatures before evicting.
DEFAULT_CACHE_BYTES = 1 << 30


class Planned:
    """What is kept per gradient signature: the plan, its buffers, and the
    description and fingerprint the cross-rank check compares."""

    __slots__ = ("plan", "buffers", "fingerprint", "description", "index_dtypes")

    def __init__(self, specs, plan, description):
        self.plan = plan
        self.buffers = BucketBuffers(plan, [s.dtype for s in specs])
        self.description = description
        self.fingerprint = fingerprint(description)
        self.index_dtypes = tuple((i, s.index_dtype) for i, s in enumerate(specs)
                                  if s.kind == SPARSE)

    @property
    def nbytes(self):
        """Bytes held by the bucket buffers."""
        return self.plan.nbytes


class PlanCache:
    """Planned entries by gradient specs, and by the fast per-call key.

    Args:
        settings: the reducer's Settings (split indices, bucket cap, and what
            the fingerprint records).
        limit_bytes: buffer bytes kept before least recently used entries are
            evicted.
    """

    def __init__(self, settings, limit_bytes=DEFAULT_CACHE_BYTES):
        self.settings = settings
        self.limit_bytes = limit_bytes
        self._entries = OrderedDict()    # specs -> Planned, least recently used first
        self._by_key = {}                # fast key -> Planned
        self.nbytes = 0

    def __len__(self):
        return len(self._entries)

    def get(self, specs):
        """The Planned entry of ``specs``, planned on a miss."""
        entry = self._entries.get(specs)
        if entry is not None:
            self._entries.move_to_end(specs)
            return entry
        plan = make_plan(specs, self.settings.split_indices, self.settings.bucket_bytes)
        entry = Planned(specs, plan, describe(specs, self.settings.agreed()))
        self._entries[specs] = entry
        self.nbytes += entry.nbytes
        self._evict()
        return entry

    def by_key(self, key):
        """The entry last stored under fast ``key``, or None."""
        return self._by_key.get(key)

    def remember(self, key, entry):
        """Store ``entry`` under fast ``key``."""
        self._by_key[key] = entry

    def _evict(self):
        while self.nbytes > self.limit_bytes and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes
            self._by_key = {k: e for k, e in self._by_key.items() if e is not old}

    def clear(self):
        """Drop every entry and its buffers."""
        self._entries.clear()
        self._by_key.clear()
        self.nbytes = 0
