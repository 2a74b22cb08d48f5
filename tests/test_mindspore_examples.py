"""The MindSpore examples run as documented, at 2 ranks, in MindSpore's
environment (scripts/test.sh: .venv-mindspore): each checks its own claim
against 1 rank trained on the whole batch."""

import pytest

pytest.importorskip("mindspore")

from helpers import outlasting  # noqa: E402
from test_examples import run_example  # noqa: E402

#: a departure job's own limit (a compiled step's first compile among it)
JOB_SECONDS = 300
pytestmark = outlasting(JOB_SECONDS)


@pytest.mark.parametrize("name, args", [("mindspore/value_and_grad.py", ()),
                                        ("mindspore/train_one_step.py", ()),
                                        ("mindspore/train_one_step.py", ("--graph",)),
                                        ("mindspore/bert_pattern.py", ())])
def test_mindspore_example_claims_hold(name, args, tmp_path):
    # bert_pattern.py's --flag allreduce path: the overflow flag's allreduce("max") is
    # tested in test_mindspore_mpi.py; MindSpore writes rank_*/ folders where it runs
    assert "claims hold: True" in run_example(name, *args, cwd=tmp_path)


DEPARTURE = """
    import mindspore as ms
    from mindspore import nn
    from mpigrad.mindspore import DistributedGradReducer
    ms.set_context(mode=ms.GRAPH_MODE if STEP_MODE == "graph" else ms.PYNATIVE_MODE)
    net = nn.Dense(4, 2)

    class Step(nn.Cell):
        def __init__(self):
            super().__init__()
            self.reducer = DistributedGradReducer(net.trainable_params(), mean=True)

        def construct(self, *grads):
            return self.reducer(grads)

    step = Step()
    grads = tuple(ms.Tensor(np.ones(p.shape, np.float32)) for p in net.trainable_params())
    step(*grads)
    MPI.COMM_WORLD.Barrier()
    if rank == 1:
        sys.exit(0)                  # leaves: its program ends normally
    time.sleep(1.0)
    began = time.monotonic()
    try:
        step(*grads)
    except Exception as exc:
        print(f"rank 0 raised after {time.monotonic() - began:.1f} s: "
              f"{str(exc).splitlines()[0]}", flush=True)
"""


@pytest.mark.parametrize("mode", ["graph", "pynative"])
def test_a_departed_peer_is_named_in_a_compiled_step_and_in_pynative(tmp_path, mode):
    """The peer's departure raises PeerError naming it on the rank left in
    the step (compiled: MindSpore's runtime adds its 3 s; docs/mindspore.md)."""
    from test_job_ends import run_job
    code, out, _ = run_job(tmp_path, DEPARTURE.replace("STEP_MODE", repr(mode)), limit=JOB_SECONDS)
    assert code == 0, out
    assert "rank 0 raised after" in out and "lost its peer rank(s) [1]" in out, out
