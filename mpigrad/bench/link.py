"""The link floor of a run across nodes: the bytes a reduction must move across the link,
timed as a raw TCP transfer in both directions at once between the first ranks of two nodes.

A bandwidth-optimal allreduce of N bytes over n nodes sends and receives 2(n-1)/n N bytes per
node (N for two nodes), whatever it does inside each node; no MPI library, hierarchy or
overlap moves fewer without compression. Each node's side of the link is limited on its own
(tc on its interface), so one pair of nodes transferring those bytes bounds every node's part.
"""

import socket
import threading

import numpy as np
from mpi4py import MPI

__all__ = ["link_bytes", "link_floor_case"]


def link_bytes(wire_bytes, nodes):
    """The bytes each node must send (and receive) across the link to allreduce ``wire_bytes``."""
    return wire_bytes * 2 * (nodes - 1) // nodes


def _exchange(conn, out, into):
    """Send ``out`` and receive ``into`` on ``conn`` at the same time (full duplex)."""
    sender = threading.Thread(target=conn.sendall, args=(out,))
    sender.start()
    view, got = memoryview(into).cast("B"), 0
    while got < len(view):
        got += conn.recv_into(view[got:], len(view) - got)
    sender.join()


def link_floor_case(comm, wire_bytes):
    """(case, nodes): a case timing the transfer of what an allreduce of ``wire_bytes`` must
    send each way across the link (``link_bytes``) between the first ranks of nodes 0 and 1
    (the other ranks wait), and the node count; (None, 1) on one node. Collective over
    ``comm``; the connection is made here, once."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    first = node.Get_rank() == 0
    node.Free()
    leaders = comm.Split(0 if first else MPI.UNDEFINED, comm.rank)
    nodes = comm.bcast(leaders.Get_size() if first else None, root=0)
    conn = None
    if first and leaders.Get_rank() < 2 and nodes > 1:
        if leaders.Get_rank() == 0:
            listener = socket.create_server(("0.0.0.0", 0))
            leaders.send((socket.gethostname(), listener.getsockname()[1]), dest=1)
            conn, _ = listener.accept()
            listener.close()
        else:
            host, port = leaders.recv(source=0)
            conn = socket.create_connection((host, port))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if first:
        leaders.Free()
    if nodes < 2:
        return None, 1
    nbytes = max(1, link_bytes(wire_bytes, nodes))
    out, into = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)

    def transfer():
        if conn is not None:
            _exchange(conn, out, into)
    return transfer, nodes
