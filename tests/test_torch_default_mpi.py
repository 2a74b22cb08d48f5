"""The "mpigrad" backend as torch's default group (init_process_group("mpigrad")
under mpiexec), probed as a hostile user would: aliased tensors, all-to-all
sizes that disagree, a too-small receive, a setting on one rank only, new
groups whose members disagree, receives from any rank, batched messages in
any order. Each ends on every rank with mpigrad's error naming the difference,
and the group goes on. Run under mpiexec -n 2 and -n 3."""

import os

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from mpi4py import MPI  # noqa: E402

import mpigrad.torch  # noqa: E402,F401  (registers the backend)
from mpigrad import StructureMismatchError  # noqa: E402

pytestmark = pytest.mark.mpi(min_size=2)

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
LAST = SIZE - 1


@pytest.fixture(scope="module", autouse=True)
def world():
    """The mpigrad world as torch's default group (no address: ranks from MPI)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    saved = {k: os.environ.pop(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
             if k in os.environ}
    dist.init_process_group("mpigrad")
    yield
    dist.destroy_process_group()
    os.environ.update(saved)


def still_sums():
    """The default group still works: a sum of ones is the rank count."""
    t = torch.ones(3)
    dist.all_reduce(t)
    assert t.tolist() == [float(SIZE)] * 3


@pytest.mark.parametrize("n", [4, 1 << 16], ids=["small", "engine"])
def test_aliased_tensors_in_a_coalesced_all_reduce_are_refused_on_every_rank(n):
    x = torch.ones(n)
    with pytest.raises(ValueError, match=r"tensors\[0\] and tensors\[1\] share memory"):
        dist.all_reduce_coalesced([x, x])
    assert torch.equal(x, torch.ones(n))          # nothing summed
    still_sums()


def test_all_to_all_single_with_splits_that_disagree_raises_on_every_rank():
    rows = 2 * SIZE
    inp, out = torch.arange(float(rows)), torch.zeros(rows)
    sends = [2] * SIZE if RANK != LAST else [1] + [2] * (SIZE - 2) + [3]
    with pytest.raises(StructureMismatchError,
                       match=rf"rank {LAST} sending 4 bytes to rank 0, which expects 8"):
        dist.all_to_all_single(out, inp, [2] * SIZE, sends)
    still_sums()


def test_all_to_all_with_sizes_that_disagree_raises_on_every_rank():
    inputs = [torch.full((2,), float(RANK)) for _ in range(SIZE)]
    outputs = [torch.zeros(3 if (RANK == LAST and r == 0) else 2) for r in range(SIZE)]
    with pytest.raises(StructureMismatchError, match=r"expecting each rank to receive what"):
        dist.all_to_all(outputs, inputs)
    still_sums()


def test_all_to_all_single_with_splits_that_agree():
    rows = [r + 1 for r in range(SIZE)]                  # rank r gets r + 1 rows of each
    inp = torch.full((sum(rows),), float(RANK))
    out = torch.zeros((RANK + 1) * SIZE)
    dist.all_to_all_single(out, inp, [RANK + 1] * SIZE, rows)
    assert out.tolist() == [float(r) for r in range(SIZE) for _ in range(RANK + 1)]


def test_a_receive_too_small_for_its_message_is_a_value_error():
    if RANK == 0:
        dist.send(torch.ones(10), dst=1)
    elif RANK == 1:
        with pytest.raises(ValueError, match="the message is larger than the 16 bytes"):
            dist.recv(torch.zeros(4), src=0)
    still_sums()


def test_the_reproducible_setting_on_one_rank_only_is_named_on_every_rank(monkeypatch):
    if RANK == LAST:
        monkeypatch.setenv("MPIGRAD_REPRODUCIBLE", "1")
    with pytest.raises(StructureMismatchError, match="'MPIGRAD_REPRODUCIBLE' differs"):
        dist.all_reduce(torch.ones(4))
    monkeypatch.delenv("MPIGRAD_REPRODUCIBLE", raising=False)
    still_sums()


def test_new_group_whose_ranks_disagree_raises_on_every_rank():
    ranks = list(range(SIZE)) if RANK != LAST else list(range(SIZE - 1))
    with pytest.raises(StructureMismatchError, match="'ranks' differs"):
        dist.new_group(ranks)
    still_sums()


def test_new_group_of_the_first_ranks():
    members = list(range(SIZE - 1)) or [0]
    group = dist.new_group(members)
    if RANK in members:
        t = torch.ones(2)
        dist.all_reduce(t, group=group)
        assert t.tolist() == [float(len(members))] * 2
    dist.barrier()


def test_a_receive_from_any_rank_names_the_sender():
    if RANK == 0:
        senders = set()
        for _ in range(SIZE - 1):
            t = torch.zeros(2)
            sender = dist.recv(t)                        # src=None: from any rank
            assert t.tolist() == [float(sender)] * 2
            senders.add(sender)
        assert senders == set(range(1, SIZE))
    else:
        dist.send(torch.full((2,), float(RANK)), dst=0)
    dist.barrier()


@pytest.mark.parametrize("receive_first", [True, False])
def test_batched_messages_in_a_ring_in_either_order(receive_first):
    right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    got, mine = torch.zeros(3), torch.full((3,), float(RANK))
    ops = [dist.P2POp(dist.irecv, got, left), dist.P2POp(dist.isend, mine, right)]
    for work in dist.batch_isend_irecv(ops if receive_first else ops[::-1]):
        work.wait()
    assert got.tolist() == [float(left)] * 3
    still_sums()


def test_an_average_past_the_float16_wires_range_whose_mean_fits_stays_finite(monkeypatch):
    """MPIGRAD_WIRE=float16 (read when the group's engine is made): 40000 on
    every rank sums past float16's 65504; the average does not."""
    monkeypatch.setenv("MPIGRAD_WIRE", "float16")
    group = dist.new_group(list(range(SIZE)))
    t = torch.full((1 << 15,), 40000.0)                   # 128 KiB: the engine's sum
    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group)
    assert torch.isfinite(t).all() and torch.allclose(t, torch.full_like(t, 40000.0))
    dist.destroy_process_group(group)


def test_a_gloo_group_asked_of_the_mpigrad_default_refuses_its_first_call_everywhere():
    """torch 2.13 hands new_group(backend="gloo") to the default group: the
    group it gets would be mpigrad's while torch calls it gloo's; its first
    call raises on every rank, naming the fix, and nothing moves."""
    group = dist.new_group(backend="gloo")
    t = torch.full((2,), float(RANK))
    with pytest.raises(ValueError, match=r"new_group\(backend='gloo'\) under the default group "
                                         r"'mpigrad'.*backend='mpigrad'"):
        dist.all_reduce(t, group=group)
    assert t.tolist() == [float(RANK)] * 2
    dist.destroy_process_group(group)
    still_sums()
