"""Surviving a lost rank (on_failure="shrink", mpigrad.elastic) and naming it
(on_failure="abort"), in subprocess jobs under Open MPI's fault tolerance:
`mpiexec --with-ft ulfm --mca btl tcp,self --mca btl_tcp_if_include lo`, or, inside
a cluster of namespaces (scripts/test.sh), the same across 2 nodes on the link,
each under a hard timeout. A rank dies with os._exit or SIGKILL before a
reduce, in the middle of a multi-bucket reduce and in a broadcast; the
survivors' results are checked against the reference over the survivors and
against each other. A second rank lost during the recovery must end the job
(this Open MPI's ULFM does not report it) or be survived, never hang.

Marked ulfm: scripts/test.sh runs them with the Open MPI wheel's python (its
mpiexec beside it); elsewhere they are deselected. The refusals on a job
without ULFM run everywhere (MPICH's and Open MPI's plain launch alike).
"""

import os
import sys
import textwrap

import pytest

from helpers import mpiexec_path, run_until

PRELUDE = """
import os, signal, sys, time
import numpy as np
from mpi4py import MPI
import mpigrad
from mpigrad import RanksLost, PeerError
rank = MPI.COMM_WORLD.rank

def die():
    os._exit(9)

def finish():
    say("done")

def die_at_piece(n, end=die):      # end() as this rank starts its n-th Allreduce piece
    calls = [0]
    Communicator = mpigrad._comm.communicator.Communicator
    real = Communicator.start_sum
    def dying(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            end()
        return real(self, *args, **kwargs)
    Communicator.start_sum = dying

def say(what):
    sys.stdout.write(f"rank {rank}: {what}\\n")    # one write: lines of ranks do not mix
    sys.stdout.flush()
"""

ULFM = ["--with-ft", "ulfm", "--mca", "btl", "tcp,self"]
ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
       "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
       "MPIGRAD_TIMEOUT": "30"}         # a stall inside mpigrad is named well within the limit


def launch(ranks, ft=True):
    """The mpiexec line of a job of ``ranks``: on the nodes of a cluster of namespaces where
    the tests run inside one (mpigrad.bench.cluster --no-mpiexec: 2 ranks a node, so 3 ranks
    are 2 + 1), else on this host; over TCP on the link, or on loopback, under ULFM with ``ft``."""
    from mpigrad.bench.cluster import from_environment
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        mpiexec = mpiexec_path()
    nodes = from_environment(2, mpiexec, ranks)
    if nodes is not None:
        return [nodes[0], *(ULFM if ft else []), *nodes[1:]]
    return [mpiexec, *(ULFM + ["--mca", "btl_tcp_if_include", "lo"] if ft else []),
            "-n", str(ranks)]


def run_job(tmp_path, body, ranks=3, ft=True, limit=45):
    """(exit status, output) of ``body`` under mpiexec; fails if the job has
    not ended within ``limit`` seconds. (After a lost rank, Open MPI 5.0.11
    sometimes waits for ever in MPI_Finalize: mpigrad bounds it, see
    mpigrad/_comm/deadman.py.)"""
    script = tmp_path / "job.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    return run_until([*launch(ranks, ft), sys.executable, str(script)], ENV, limit)


def lines_of(output, rank):
    return [line for line in output.splitlines() if line.startswith(f"rank {rank}:")]


def survivors_said(output, ranks, text):
    for rank in ranks:
        assert any(text in line for line in lines_of(output, rank)), \
            f"rank {rank} did not say {text!r}:\n{output}"


ulfm = pytest.mark.ulfm


@ulfm
@pytest.mark.parametrize("how", ["os._exit", "SIGKILL"])
def test_a_rank_lost_before_a_reduce_shrinks_and_the_survivors_go_on(tmp_path, how):
    kill = "die()" if how == "os._exit" else "os.kill(os.getpid(), signal.SIGKILL)"
    _, out = run_job(tmp_path, f"""
        reducer = mpigrad.Reducer(on_failure="shrink")
        grads = [np.full(1000, rank + 1.0, np.float32), np.full(7, rank + 1.0, np.float64)]
        reducer.reduce([g.copy() for g in grads])
        if rank == 2:
            {kill}
        try:
            reducer.reduce(grads, inplace=True)
            say("no error")
        except RanksLost as lost:
            unchanged = all((g == rank + 1).all() for g in grads)
            say(f"lost {{list(lost.failed)}} size {{lost.size}} unchanged {{unchanged}}")
        out = reducer.reduce(grads, inplace=True)
        survivors = [r + 1.0 for r in (0, 1)]
        ok = all((o == sum(survivors) / 2).all() for o in out)
        same = reducer.comm.allgather([o.tobytes() for o in out])
        say(f"after: comm size {{reducer.comm.size}} degree {{reducer.degree}} "
            f"reference {{ok}} identical {{same[0] == same[1]}}")
        reducer.free()
        finish()
        """)
    survivors_said(out, (0, 1), "lost [2] size 2 unchanged True")
    survivors_said(out, (0, 1), "after: comm size 2 degree 2 reference True identical True")


@ulfm
def test_a_rank_lost_in_the_middle_of_a_multi_bucket_reduce(tmp_path):
    _, out = run_job(tmp_path, """
        reducer = mpigrad.Reducer(on_failure="shrink", bucket_bytes=4000, chunk_bytes=1000)
        grads = [np.full(1000, rank + 1.0, np.float32) for _ in range(6)]     # 6 buckets
        reducer.reduce([g.copy() for g in grads])
        if rank == 2:                        # dies at its third bucket's first piece
            die_at_piece(9)                  # (4 pieces of 1000 bytes a bucket)
        try:
            reducer.reduce(grads, inplace=True)
        except RanksLost as lost:
            say(f"lost {list(lost.failed)} unchanged {all((g == rank + 1).all() for g in grads)}")
        out = reducer.reduce(grads, inplace=True)
        say(f"reference {all((o == 1.5).all() for o in out)}")
        finish()
        """)
    survivors_said(out, (0, 1), "lost [2] unchanged True")
    survivors_said(out, (0, 1), "reference True")


@ulfm
def test_two_of_three_ranks_killed_in_one_step_the_survivor_goes_on_and_the_job_ends(tmp_path):
    code, out = run_job(tmp_path, """
        reducer = mpigrad.Reducer(on_failure="shrink", bucket_bytes=4000, chunk_bytes=1000)
        grads = [np.full(1000, rank + 1.0, np.float32) for _ in range(6)]
        reducer.reduce([g.copy() for g in grads])
        if rank > 0:                         # both die in the middle of a reduce
            die_at_piece(3 + 4 * rank, lambda: os.kill(os.getpid(), signal.SIGKILL))
        for step in range(3):                # the losses may come one call apart
            try:
                reducer.reduce(grads, inplace=True)
            except RanksLost as lost:
                say(f"lost {list(lost.failed)} size {lost.size}")
        out = reducer.reduce(grads, inplace=True)
        say(f"alone {reducer.comm.size == 1}: reference {all((o == 1.0).all() for o in out)}")
        finish()
        """)
    survivors_said(out, (0,), "alone True: reference True")


@ulfm
def test_sharded_torch_training_reshards_over_the_survivors(tmp_path):
    """ShardedOptimizer + elastic.State: rank 2 of 3 dies in step 4; the
    survivors restore the last commit (the whole optimizer state), reshard it
    over 2 ranks, and finish as 1 rank on the whole batch would."""
    pytest.importorskip("torch")
    _, out = run_job(tmp_path, """
        import torch
        import mpigrad.torch as mgt

        def model():
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(),
                                       torch.nn.Linear(7, 1))

        g = torch.Generator().manual_seed(3)
        x, y = torch.randn(8, 12, 5, generator=g), torch.randn(8, 12, 1, generator=g)

        def loss(net, k, part, parts):      # this rank's rows of step k's batch
            rows = slice(part * 12 // parts, (part + 1) * 12 // parts)
            return torch.nn.functional.mse_loss(net(x[k, rows]), y[k, rows])

        net = model()
        opt = mgt.ShardedOptimizer(torch.optim.Adam(net.parameters(), lr=0.05),
                                   on_failure="shrink")
        state = mpigrad.elastic.State({"model": net.state_dict(), "opt": opt.state_dict(),
                                       "step": 0}, opt.reducer)
        state.on_reset(lambda state, lost: opt.load_state_dict(state.tree["opt"]))

        def train(state):
            while state.tree["step"] < 8:
                k, comm = state.tree["step"], opt.reducer.comm
                if k == 4 and rank == 2:
                    die()
                opt.zero_grad()
                loss(net, k, comm.rank, comm.size).backward()
                opt.step()
                state.tree["opt"] = opt.state_dict()
                state.tree["step"] = k + 1
                state.commit()

        mpigrad.elastic.run(train, state)
        reference = model()
        ref_opt = torch.optim.Adam(reference.parameters(), lr=0.05)
        for k in range(8):
            ref_opt.zero_grad()
            loss(reference, k, 0, 1).backward()
            ref_opt.step()
        off = max(float((p - q).detach().abs().max())
                  for p, q in zip(net.parameters(), reference.parameters()))
        mine = [p.detach().numpy().tobytes() for p in net.parameters()]
        same = opt.reducer.allgather_object(mine)
        say(f"size {opt.reducer.comm.size} close {off <= 1e-5} identical {same[0] == same[1]}")
        finish()
        """)
    survivors_said(out, (0, 1), "size 2 close True identical True")


@ulfm
def test_horovod_elastic_training_goes_on_over_the_survivors(tmp_path):
    """hvd.elastic.TorchState + hvd.elastic.run (mpigrad.horovod.torch):
    rank 2 of 3 dies in step 3 of 6; the survivors shrink, restore the last
    commit, and finish with hvd.size() == 2 and identical parameters."""
    pytest.importorskip("torch")
    _, out = run_job(tmp_path, """
        import torch
        import mpigrad.horovod.torch as hvd

        hvd.init()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
        resets = []
        state.register_reset_callbacks([lambda: resets.append(hvd.size())])

        @hvd.elastic.run
        def train(state):
            while state.step < 6:
                if state.step == 3 and rank == 2:
                    die()
                opt.zero_grad()
                x = torch.full((2, 4), float(hvd.rank() + 1))
                model(x).sum().backward()
                opt.step()
                state.step += 1
                state.commit()
                hvd.allreduce(torch.ones(1), name="heartbeat")

        train(state)
        blobs = hvd.allgather_object([p.detach().numpy().tobytes() for p in model.parameters()])
        say(f"size {hvd.size()} step {state.step} resets {resets} "
            f"identical {all(b == blobs[0] for b in blobs)}")
        finish()
        """)
    survivors_said(out, (0, 1), "size 2 step 6 resets [2] identical True")


@ulfm
def test_a_rank_lost_in_a_broadcast(tmp_path):
    _, out = run_job(tmp_path, """
        reducer = mpigrad.Reducer(on_failure="shrink")
        tree = {"w": np.full(5, float(rank)), "step": rank}
        if rank == 2:
            die()                            # never reaches the broadcast
        try:
            reducer.broadcast(tree)
        except RanksLost as lost:
            say(f"lost {list(lost.failed)} size {lost.size}")
        tree = reducer.broadcast(tree)
        say(f"after: w {tree['w'].tolist()} step {tree['step']} size {reducer.comm.size}")
        finish()
        """)
    survivors_said(out, (0, 1), "lost [2] size 2")
    survivors_said(out, (0, 1), "after: w [0.0, 0.0, 0.0, 0.0, 0.0] step 0 size 2")


@ulfm
@pytest.mark.parametrize("on_failure", ["shrink", "abort"])
def test_a_rank_lost_while_the_reducer_is_made_is_raised_by_its_first_call(tmp_path,
                                                                           on_failure):
    # every survivor is inside the construction's check when the loss shows (a
    # survivor still there while a peer that completed it dies is the same case
    # on that rank, and was a race in the tests above): the Reducer is made on
    # the survivors, and its first call raises, as a call in progress would.
    # (A rank lost before the communicator's duplication is the watchdog's: the
    # caller's communicator has lost it, and MPI's duplication cannot complete.)
    _, out = run_job(tmp_path, f"""
        if rank == 2:                        # dies as the construction's check starts
            from mpigrad._comm.communicator import Communicator
            def dying(*args, **kwargs):
                time.sleep(1)                # the peers' duplication done too
                die()
            Communicator.start_agreement = dying
        reducer = mpigrad.Reducer(on_failure="{on_failure}")
        say(f"made: size {{reducer.comm.size}} degree {{reducer.degree}}")
        grads = [np.full(10, rank + 1.0)]
        for attempt in range(2):
            try:
                out = reducer.reduce(grads)
                say(f"reduced {{out[0].tolist() == [1.5] * 10}}")
            except RanksLost as lost:
                say(f"RanksLost {{list(lost.failed)}} size {{lost.size}}")
            except PeerError as error:
                say(f"PeerError {{error.ranks}}")
        finish()
        """)
    survivors_said(out, (0, 1), "made: size 2 degree 2")
    if on_failure == "shrink":
        survivors_said(out, (0, 1), "RanksLost [2] size 2")
        survivors_said(out, (0, 1), "reduced True")
    else:
        for rank in (0, 1):
            said = lines_of(out, rank)
            assert sum("PeerError (2,)" in line for line in said) == 2, out


@ulfm
def test_a_second_rank_lost_during_the_recovery_ends_the_job_without_a_hang(tmp_path):
    # Open MPI 5.0.11's ULFM reports no loss on a shrunk communicator (and its
    # Ishrink fails): the survivors cannot go on, but the job must end
    code, out = run_job(tmp_path, """
        reducer = mpigrad.Reducer(on_failure="shrink", timeout=5)
        if rank == 3:
            die()
        if rank == 2:                        # dies while the survivors rebuild
            def dying(self, comm):
                die()
            mpigrad._comm.communicator.Communicator.rejoin = dying
        try:
            reducer.reduce([np.ones(10, np.float32)])
        except RanksLost as lost:
            say(f"lost {list(lost.failed)} size {lost.size}")
            out = reducer.reduce([np.ones(10, np.float32)])
            say(f"carried on: {out[0].tolist() == [1.0] * 10}")
        finish()
        """, ranks=4, limit=60)
    for rank in (0, 1):
        said = " ".join(lines_of(out, rank))
        assert code != 0 or ("lost [2, 3] size 2" in said and "carried on: True" in said), out


@ulfm
def test_abort_names_the_lost_rank_on_every_survivor(tmp_path):
    _, out = run_job(tmp_path, """
        reducer = mpigrad.Reducer()                          # on_failure="abort"
        if rank == 2:
            die()
        try:
            reducer.reduce([np.ones(100, np.float32)])
        except PeerError as error:
            say(f"PeerError {error.ranks}: {error}")
        try:
            reducer.reduce([np.ones(100, np.float32)])
        except PeerError as error:
            say(f"again {error.ranks}")
        finish()
        """)
    survivors_said(out, (0, 1), "PeerError (2,): the Reducer lost ranks of its 3 rank(s) [2]")
    survivors_said(out, (0, 1), "again (2,)")


@ulfm
def test_the_elastic_example_survives_a_lost_rank(tmp_path):
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "elastic.py")

    def finished(output):              # see run_job: the launcher may not end
        return all(any("parameters identical" in line for line in lines_of(output, r))
                   for r in (0, 1))
    _, out = run_until([*launch(3), sys.executable, example], ENV, 60, finished)
    for rank in (0, 1):
        assert any("lost ranks [2], 2 left" in line and "30 steps done" in line
                   and "parameters identical on the survivors: True" in line
                   for line in lines_of(out, rank)), out


@pytest.mark.skipif(mpiexec_path() is None, reason="mpiexec not found")
def test_shrink_without_fault_tolerance_is_refused_on_every_rank(tmp_path):
    code, out = run_job(tmp_path, """
        try:
            mpigrad.Reducer(on_failure="shrink")
        except (ValueError, PeerError) as error:
            say(f"refused {type(error).__name__}: {error}")
        """, ranks=2, ft=False)
    for rank in (0, 1):
        line = " ".join(lines_of(out, rank))
        assert "refused ValueError: on_failure='shrink'" in line, out
        assert "--with-ft ulfm" in line or "needs an MPI library with ULFM" in line, out
