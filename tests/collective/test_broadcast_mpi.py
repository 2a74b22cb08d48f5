"""_collective/broadcast.py: BROADCAST through the layer: root's arrays
overwrite every rank's, root's payload comes back on every rank (any size,
none), from every root."""

import numpy as np
import pytest

from mpigrad._collective import Kind

from .specs import spec

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.mark.parametrize("payload", [None, b"", b"root's bytes" * 100])
def test_roots_arrays_and_payload_on_every_rank(group, payload):
    for root in range(group.size):
        arrays = [np.full((2, 3), group.rank, np.float32), np.arange(5) * group.rank,
                  np.zeros(0, np.int8)]
        mine = payload + bytes([group.rank]) if payload is not None and group.rank == root \
            else payload
        got = group.run(spec(Kind.BROADCAST, "broadcast", arrays, root=root, payload=mine))
        assert (arrays[0] == root).all() and np.array_equal(arrays[1], np.arange(5) * root)
        assert got == (None if payload is None else payload + bytes([root]))
