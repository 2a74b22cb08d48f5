"""The collective layer: the one way in for every collective a face asks for.

A face translates its call into a typed ``Collective`` (spec.py: the kind,
the op, this rank's arrays in and out, the root, the names and values the
ranks share), checks its op against the one op table (ops.py) under its
rules, and hands it to its ``Group`` (group.py), whose route table sends it
to the engine (large floating-point sums and reduce-scatters) or to its
kind's module (one per kind: allreduce.py, reduce_scatter.py, broadcast.py,
allgather.py, alltoall.py, barrier.py; messages.py for point-to-point),
always after one agreement. ``MatchingGroup`` (matched.py) serves Horovod,
which agrees by rounds of its own.
"""

from .._comm.tally import Statistics, statistics
from .group import ENGINE_BYTES, Group
from .matched import MatchingGroup, Placement
from .messages import Message
from .spec import Collective, Kept, Kind, Request

__all__ = ["Collective", "Kept", "Kind", "Request", "Group", "MatchingGroup", "Placement",
           "Message", "ENGINE_BYTES", "Statistics", "statistics"]
