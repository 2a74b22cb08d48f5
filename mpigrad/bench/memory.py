"""The memory the benchmark's cases hold against what the machine has.

Every case is alive for the whole comparison (the rounds interleave them), so
its memory adds up: 22-24 copies of the layout on each rank for mpigrad's own
cases (their gradients, buckets, results and floors), 14 more and torch's own
1.4 GB for the peers (gloo, DDP and FSDP2 models), 12 more for the faces (peak
resident memory at 2 ranks: ResNet-50's 97.5 MiB, GPT-2 small's 475 MiB, the
1 MiB "small" layout; counted below with a copy or two to spare). GPT-2 small
with the peers needs about 50 GB at 2 ranks: on a machine of 24 GB the kernel
ended the run (signal 9, no word of why), and its own cases alone (22.5 GB) did
where 22.6 GB were available. Now the comparison is refused, before anything
is allocated, where mpigrad's own cases do not fit the machine's available
memory (``NotEnoughMemory``: what they need, what there is, what fits), and the
peers and the faces are set up only where theirs fits what is left, else
skipped with a note. Every rank agrees (each machine counts every rank on it:
network namespaces of one machine share its memory)."""

import math
from typing import Any, NamedTuple, Optional, Sequence

__all__ = ["Cases", "CORE", "PEERS", "FACES", "Budget", "NotEnoughMemory",
           "available_bytes", "machine_ranks"]

_GB = 1 << 30


class NotEnoughMemory(RuntimeError):
    """mpigrad's own cases do not fit the machines' available memory."""


class Cases(NamedTuple):
    """What a group of cases holds on each rank: ``fixed`` bytes and ``copies``
    of the layout's bytes (its wire dtype)."""

    what: str
    fixed: float
    copies: float

    def per_rank(self, layout_bytes: int) -> int:
        return math.ceil(self.fixed + self.copies * layout_bytes)


CORE = Cases("mpigrad's cases", 0.3 * _GB, 24)
PEERS = Cases("the peers' cases (torch gloo, DDP, FSDP2; Horovod)", 1.4 * _GB, 16)
FACES = Cases("the faces' cases (Horovod, jax, the optimizers)", 0.2 * _GB, 14)


def available_bytes(meminfo: str = "/proc/meminfo") -> Optional[int]:
    """The memory this machine can still give (Linux's MemAvailable), None
    where the system does not say."""
    try:
        with open(meminfo) as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _machine() -> str:
    """This machine's identity: its kernel's boot id (shared by its network and
    UTS namespaces, as its memory is), else its host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as text:
            return text.read().strip()
    except OSError:
        import socket
        return socket.gethostname()


def machine_ranks(comm: Any) -> int:
    """How many ranks of ``comm`` share this rank's machine (collective)."""
    machines: Sequence[str] = comm.allgather(_machine())
    return machines.count(machines[comm.Get_rank()])


class Budget:
    """The cases' memory on ``comm``'s machines for a layout of ``layout_bytes``,
    against the memory each machine has available before any case is set up
    (collective: made and asked by every rank; most of a case's memory is
    touched only once it runs, so what is available later says little)."""

    def __init__(self, comm: Any, layout_bytes: int) -> None:
        self.comm = comm
        self.layout_bytes = layout_bytes
        self.ranks = machine_ranks(comm)
        self.available = available_bytes()
        self.taken = 0                  # by the cases that fit, on this rank's machine

    def take(self, cases: Cases) -> Optional[str]:
        """Count ``cases`` in where they fit beside those taken before them on
        every machine; else why not (the first machine short of it, the same
        words on every rank)."""
        per_rank = cases.per_rank(self.layout_bytes)
        need = self.ranks * per_rank
        mine = None
        if self.available is not None and self.taken + need > self.available:
            beside = f", beside the {self.taken / _GB:.1f} GB of the cases before them" \
                if self.taken else ""
            mine = (f"{cases.what} need about {need / _GB:.1f} GB on a machine "
                    f"({self.ranks} rank(s) x {per_rank / _GB:.1f} GB for this layout of "
                    f"{self.layout_bytes / 2**20:.1f} MiB){beside}, which has "
                    f"{self.available / _GB:.1f} GB available")
        reasons: Sequence[Optional[str]] = self.comm.allgather(mine)
        reason = next((r for r in reasons if r is not None), None)
        if reason is None:
            self.taken += need
        return reason
