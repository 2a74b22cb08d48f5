import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from helpers import COMM_KINDS, make_comm  # noqa: E402


@pytest.fixture(params=COMM_KINDS)
def comm(request):
    """The communicator a collective test reduces over: COMM_WORLD, a split of
    it (even/odd world ranks) and one of size 1. Expected values come from its
    size; modules that need COMM_WORLD only define their own ``comm``."""
    comm, owned = make_comm(request.param)
    yield comm
    if owned:
        comm.Free()
