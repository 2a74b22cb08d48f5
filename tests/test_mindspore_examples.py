"""The MindSpore examples run as documented, at 2 ranks, in MindSpore's
environment (scripts/test.sh: .venv-mindspore): each checks its own claim
against 1 rank trained on the whole batch."""

import pytest

pytest.importorskip("mindspore")

from test_examples import run_example  # noqa: E402


@pytest.mark.parametrize("name, args", [("mindspore/value_and_grad.py", ()),
                                        ("mindspore/train_one_step.py", ()),
                                        ("mindspore/train_one_step.py", ("--graph",)),
                                        ("mindspore/bert_pattern.py", ())])
def test_mindspore_example_claims_hold(name, args, tmp_path):
    # bert_pattern.py's --flag allreduce path: the overflow flag's allreduce("max") is
    # tested in test_mindspore_mpi.py; MindSpore writes rank_*/ folders where it runs
    assert "claims hold: True" in run_example(name, *args, cwd=tmp_path)
