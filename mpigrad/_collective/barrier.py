"""BARRIER: the agreement itself. No rank's agreement completes before every
rank has begun its own (its result depends on every rank's), so once it
has passed, every rank has arrived; nothing more moves."""

from typing import Optional

from .._comm.checked import Pending
from .._comm.communicator import Communicator
from .spec import Carriage, Collective

__all__ = ["check", "extra", "carriage", "start"]


def check(spec: Collective, comm: Communicator) -> None:
    """Nothing beyond the agreement."""


def extra(spec: Collective) -> int:
    """Nothing rides on the agreement."""
    return 0


def carriage(spec: Collective, comm: Communicator, capacity: int) -> Optional[Carriage]:
    """Nothing is carried in the agreement: the data moves after it."""
    return None


def start(spec: Collective, comm: Communicator, extra: int) -> Pending:
    """Nothing to start: the agreement was the barrier."""
    return Pending(comm, [], lambda: None)
