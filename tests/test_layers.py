"""The house's rules that the code itself can be held to (serial: no MPI job).

- Every collective mpigrad starts, in every face, starts in one place:
  ``Communicator.start`` (mpigrad/_comm/communicator.py), after the watch's
  pre-start check. Only the watch itself (the duplicate, its token) and
  ULFM's recovery agreement start MPI calls of their own; the benchmark's
  baselines are MPI's own collectives, timed on purpose.
- The import contract in setup.cfg (layers, faces through the engine, no
  circle) is checked by import-linter in scripts/test.sh.
"""

import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "mpigrad"

# a non-blocking collective started on an mpi4py communicator
_START = re.compile(r"\.I(allreduce|bcast|allgather|allgatherv|alltoall|alltoallv|alltoallw|"
                    r"reduce_scatter|reduce_scatter_block|reduce|barrier|gather|gatherv|"
                    r"scatter|scatterv|scan|exscan|agree|dup|shrink)\(")

# a persistent collective made or started (the agreements' exchange: _comm/exchange.py)
_PERSISTENT = re.compile(r"\.([A-Z][a-z]*(_[a-z]+)*_init|Start)\(")

#: where a start may stand: the one start, the watch, ULFM's recovery, the bench's baselines
_ALLOWED = {"_comm/communicator.py", "_comm/watch.py", "_comm/ulfm.py"}


def _sources():
    return sorted(path for path in PACKAGE.rglob("*.py")
                  if path.relative_to(PACKAGE).parts[0] != "bench")


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_collectives_start_only_in_the_communicator(path):
    where = str(path.relative_to(PACKAGE))
    starts = [f"{where}:{n}: {line.strip()}"
              for n, line in enumerate(path.read_text().splitlines(), 1)
              if _START.search(line.split("#", 1)[0]) or _PERSISTENT.search(line.split("#", 1)[0])]
    if where == "_comm/communicator.py":      # Communicator.start: getattr(comm, "I" + name);
        # start_agreement: the exchange's persistent Allgather, or a new Iallgather
        assert [s.split(": ", 1)[1] for s in starts] == [
            "request = self.comm.Iallgather(*exchange.buffers)", "request.Start()"], starts
    elif where not in _ALLOWED:
        assert not starts, (f"a collective started outside Communicator.start (the watch's "
                            f"pre-start check): {starts}")


def test_the_rule_sees_a_start():
    assert _START.search("request = helper.comm.Iallgatherv([a, t], [b, t])")
    assert _PERSISTENT.search("comm.Allgather_init(*buffers)")
    assert _PERSISTENT.search("comm.Reduce_scatter_block_init(a, b)")
    assert _PERSISTENT.search("request.Start()")
    assert not _START.search("helper.start('Allgatherv', args, what)")
