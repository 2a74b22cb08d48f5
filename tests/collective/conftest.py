"""The collective layer's own tests (``mpigrad._collective``): one file per
module of the package, each kind run through ``Group.run`` as a face hands it a
``Collective`` (made by ``specs.spec``), at 2 and 3 ranks (and on a split and a
size-1 communicator: the root conftest's ``comm``), against references computed
from the rank count."""

import pytest

from mpigrad._collective import Group


@pytest.fixture
def group(comm):
    """A Group of its own over ``comm``, with point-to-point messages."""
    made = Group.over(comm, timeout=120, point_to_point=True)
    yield made
    made.free()
