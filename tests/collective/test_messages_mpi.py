"""_collective/messages.py: point-to-point messages on a group's own split: a
ring of sends and receives (several arrays a message each, in order), a
receive from whichever rank sends first, and the barrier's arrivals."""

import gc
import weakref

import numpy as np
import pytest
from mpi4py import MPI

from mpigrad._comm.communicator import Communicator

pytestmark = pytest.mark.mpi(min_size=2)


def test_a_ring_of_messages(group):
    size, rank = group.size, group.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    outgoing = [np.full(3, rank, np.float32), np.arange(rank + 1)]
    incoming = [np.empty(3, np.float32), np.empty(left + 1, np.int64)]
    receive = group.post("Recv", incoming, left, 7, "a ring's receive")
    send = group.post("Send", outgoing, right, 7, "a ring's send")
    receive.wait()
    send.wait()
    assert (incoming[0] == left).all() and np.array_equal(incoming[1], np.arange(left + 1))


def test_a_receive_from_any_rank(group):
    if group.size == 1:
        pytest.skip("no other rank to send")
    if group.rank == 0:
        got = np.empty(1, np.int64)
        senders = set()
        for _ in range(group.size - 1):
            group.post("Recv", [got], None, 9, "a receive from any rank").wait()
            senders.add(int(got[0]))
        assert senders == set(range(1, group.size))
    else:
        group.post("Send", [np.array([group.rank])], 0, 9, "a send to rank 0").wait()


def test_a_receive_from_any_rank_takes_one_array(group):
    with pytest.raises(ValueError, match="takes one tensor, got 2"):
        group.post("Recv", [np.empty(1), np.empty(1)], None, 9, "a receive from any rank")


def test_every_rank_arrives(group):
    """The barrier's arrivals: no rank missing once all came."""
    assert group.arrivals(60.0, 11) == []


def test_a_call_left_with_a_receive_in_flight_keeps_its_buffer():
    """A call ended by an exception with an operation still in flight keeps that
    operation's buffers for good: MPI may still write a peer's data into them
    (here a receive nothing will match, on this rank's own communicator)."""
    comm = Communicator(MPI.COMM_SELF, timeout=60)
    held = None
    with pytest.raises(KeyboardInterrupt):
        with comm.call():
            buffer = np.empty(8, np.uint8)
            held = weakref.ref(buffer)
            comm.start_message("Recv", buffer, 0, 5, "a receive nothing sends",
                               comm.split("messages"))
            del buffer
            raise KeyboardInterrupt
    gc.collect()
    assert held() is not None
