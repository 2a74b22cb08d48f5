"""The benchmark CLI: layouts as the references say, and short runs under mpiexec -n 2."""

import json
import math
import re
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import STACKS_ENV, mpiexec_path, outlasting, stop_job
from mpigrad.bench.layouts import load_layout

#: a benchmark run's own limit
RUN_SECONDS = 300
pytestmark = outlasting(RUN_SECONDS)

REFERENCE = {"resnet50": (161, 25_557_032), "bert_base": (199, 109_482_240),
             "gpt2_small": (148, 124_439_808), "small": (1000, 256_000)}


@pytest.mark.parametrize("name", list(REFERENCE))
def test_layouts_match_the_reference_counts(name):
    shapes = load_layout(name)
    assert (len(shapes), sum(math.prod(s) for s in shapes)) == REFERENCE[name]


def test_layout_from_json_file_and_bad_name(tmp_path):
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps([[2, 3], [4]]))
    assert load_layout(str(path)) == [(2, 3), (4,)]
    path.write_text(json.dumps({"tensors": 3, "params": [{"shape": [1]}]}))
    with pytest.raises(ValueError, match="'tensors' says 3, the shapes give 1"):
        load_layout(str(path))
    with pytest.raises(ValueError, match="expecting one of resnet50"):
        load_layout("vgg")


def bench(*args, limit=RUN_SECONDS):
    """The bench's stdout on 2 ranks; a run past ``limit`` fails with what it
    wrote and its ranks' stacks."""
    mpiexec = mpiexec_path()
    if mpiexec is None:
        pytest.skip("mpiexec not found")
    proc = subprocess.Popen([mpiexec, "-n", "2", sys.executable, "-m", "mpi4py", "-m",
                             "mpigrad.bench", "--repeats", "2", "--warmup", "1", *args],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **STACKS_ENV, "PYTHONWARNINGS": "ignore"})
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        alive = stop_job(proc, proc.stdout)
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"the bench hung past {limit} s; its processes then:\n{alive}\n"
                    f"it printed:\n{out}\n{err}")
    assert proc.returncode == 0, out + err
    return out


def test_bench_table_is_verified_with_targets_for_developers():
    out = bench("--layout", "small", "--backward-ms", "5", "--no-peers", "--targets",
                "--sharded", "--details")
    for case in ("mpigrad reduce", "mpigrad zero-copy", "mpi floor", "copy floor",
                 "shared-bucket floor",
                 "per-tensor Allreduce", "backward overlapped"):
        assert case in out
    assert "result verified on every rank: yes" in out
    assert "mpigrad inplace, sum" in out         # the Reducer's default (mean) first
    assert "vs per-tensor loop" in out and "overlap with backward" in out
    assert "per-tensor loop / reduce: " in out and "(target >= 3: " in out
    # a sharded step's communication, its round trip verified
    for case in ("mpigrad reduce_scatter ", "mpigrad allgather_shards ",
                 "mpigrad reduce_scatter + allgather_shards ",
                 "reduce_scatter + allgather_shards / mpi floor (the same bytes): "):
        assert case in out


def test_each_cases_inputs_are_rewritten_from_its_own_arrays():
    """A case's prepare writes its own inputs afresh, no other case's; a case named in two
    input groups is refused (the float32 comparison of a half-precision run once had its
    inputs overwritten by the in-place cases', so its own were never rewritten)."""
    from mpigrad.bench.suite import _prepare_inputs
    ones, twos = np.ones(3), np.full(3, 2.0)
    cases = {"in place": None, "float32": None}
    prepare = _prepare_inputs(cases, {("in place",): [ones], ("float32",): [twos]})
    ones[:], twos[:] = 5, 7
    prepare["float32"]()
    assert twos.tolist() == [2, 2, 2] and ones.tolist() == [5, 5, 5]
    with pytest.raises(ValueError, match=r"\['float32'\] in more than one group"):
        _prepare_inputs(cases, {("float32",): [twos], ("in place", "float32"): [ones]})


def fake_result(spread=1.1, **times_ms):
    """A result as run_suite returns it, with the given min times (and
    medians ``spread`` times them)."""
    from mpigrad.bench.timing import Timing
    timings = {}
    for name, ms in times_ms.items():
        timings[name.replace("_", " ")] = t = Timing(name)
        t.times = [ms / 1e3, ms / 1e3 * spread]
    return {"layout": "resnet50", "dtype": "float32", "tensors": 161, "elements": 25_557_032,
            "wire_bytes": 102_228_128, "ranks": 2, "thread_level": "multiple", "mean": True,
            "mpi": "MPICH Version: 5.0.2", "floor_chunk_bytes": 4 << 20, "chunk_sweep": {},
            "timings": timings, "verified": True, "notes": [], "transport_kind": "shm",
            "cores": 2, "node_ranks": 2,
            "backends": {"mpigrad reduce": "cross-memory", "mpigrad reduce inplace": "cross-memory",
                         "mpigrad zero-copy": "node memory"}}


def test_bench_report_for_a_user_and_for_developers():
    from mpigrad.bench.report import render
    result = fake_result(**{"mpigrad_reduce": 22.0, "mpigrad_reduce_inplace": 21.0,
                            "mpigrad_zero-copy": 11.0, "mpi_floor": 12.0,
                            "copy_floor": 11.5, "shared-bucket_floor": 8.0,
                            "per-tensor_Allreduce": 25.0,
                            "mpigrad inplace, a case with a long name": 30.0,
                            "backward_only": 40.0, "backward_then_reduce": 60.0,
                            "backward_overlapped": 75.0})
    result["casts"] = {"kernels": "C (portable)",
                       "gb_per_s": {"memcpy float32": 20.0, "float16 -> float32": 10.0}}
    out = render(result, details=True)
    assert ("note: half-precision kernels: C (portable); memcpy 20.0 GB/s; "
            "float16 -> float32 10.0 GB/s (0.50x memcpy)") in out
    assert "target" not in out and "MISSED" not in out
    assert "hides -" not in out and "none measurable" in out and "2 ranks share 2 cores" in out
    assert "reduce(grads, inplace=True)  21.00" in out
    assert "1.19x (1.19-1.19)" in out          # 25 / 21, the same in both repeats
    assert "1.09x (1.09-1.09)" in out and ") ~" not in out
    # a case 21.5 then 30 ms against in place's 21 then 23.1: a range, within noise
    result["timings"]["per-tensor Allreduce"].times = [0.0215, 0.030]
    out = render(result, details=True)
    assert "1.02x (1.02-1.30) ~" in out
    # each call against the floor of its path, named with the traffic it needs
    assert re.search(r"copy floor +11\.50 +reads N, writes N \(a copy\) .*"
                     r"reduce\(grads, inplace=True\) 1\.83x", out)
    assert re.search(r"shared-bucket floor +8\.00 +reads N, writes N/p .*"
                     r"zero-copy: bucket_views 1\.38x", out)
    assert "the machine looks loaded" not in out
    assert ("the call to pick here: zero-copy: bucket_views (11.00 ms, 1.95x faster than the "
            "per-tensor loop)\n    grads = reducer.bucket_views(grads); then each step: "
            "reducer.reduce(grads, inplace=True)   (the README's first snippet)\n"
            "    with torch, mpigrad.torch.DistributedOptimizer") in out
    table = out[out.index("every case"):].split("\n\n")[0].splitlines()[1:]
    assert len(table) == 12 and len({len(line) for line in table}) == 1    # right-aligned
    out = render(result, targets=True)
    assert ("mpi floor / inplace (mean): 0.571 (0.571-0.571 over the repeats) "
            "(target >= 1: MISSED)") in out
    assert re.search(r"per-tensor loop / reduce: 0\.977 .*\(target >= 1\.3: MISSED\)", out)
    # less than nothing hidden is noise: no negative share is printed
    assert ("overlap: share of the communication hidden behind backward: 0.000 "
            "(-0.750 measured: none, within noise)") in out
    assert not re.search(r"(^|[ (:])-\d", out.replace("-0.750 measured", ""))
    assert "2 ranks on MPICH 5.0.2, transport shm" in out and "Version:" not in out
    rows = render(result, "csv").splitlines()
    assert rows[0].startswith("kind,case,min_ms") and rows[1].startswith("case,mpigrad reduce,")
    assert any(r.startswith("ratio,") and ",mpi floor / inplace (mean),0.571" in r
               and ",1.0,True,False," in r for r in rows)


def test_bench_first_screen_says_which_call_to_pick_in_a_few_lines():
    from mpigrad.bench.report import render
    result = fake_result(spread=1.7, **{"mpigrad_reduce": 22.0, "mpigrad_reduce_inplace": 21.0,
                                        "mpigrad_zero-copy": 11.0, "mpi_floor": 12.0,
                                        "copy_floor": 11.5, "per-tensor_Allreduce": 25.0})
    result["notes"] = ["a detail"]
    lines = render(result).splitlines()
    assert len(lines) <= 16
    order = ["layout resnet50", "warning: the machine looks loaded", "mpigrad on 2 ranks",
             "  the call to pick here: zero-copy", "result verified on every rank: yes",
             "(--details: the floors, every one of the 6 cases and the 1 notes)"]
    at = [next(i for i, line in enumerate(lines) if line.startswith(o)) for o in order]
    assert at == sorted(at) and at[-1] == len(lines) - 1
    assert not any(w in "\n".join(lines) for w in ("floor  ", "every case", "note: a detail",
                                                     "git+"))
    details = render(result, details=True)
    assert "every case" in details and "note: a detail" in details


def test_bench_report_says_when_the_machine_looks_loaded():
    from mpigrad.bench.report import render
    out = render(fake_result(spread=1.7, mpigrad_reduce=20.0, mpi_floor=10.0), details=True)
    warning = "warning: the machine looks loaded or noisy: the cases' median times are 1.35x"
    assert warning in out and out.index(warning) < out.index("every case")
    assert "looks loaded" not in render(fake_result(spread=1.2, mpigrad_reduce=20.0))


def test_bench_on_one_rank_says_how_to_run_it_and_fails():
    proc = subprocess.run([sys.executable, "-m", "mpigrad.bench", "--layout", "small"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "1 rank has nothing to compare" in proc.stderr
    assert "mpiexec -n 2 mpigrad-bench" in proc.stderr


class _OneMachine:
    """A communicator's allgather as every rank of a machine would answer it."""

    def __init__(self, machines, rank=0):
        self.machines, self.rank = machines, rank

    def Get_rank(self):
        return self.rank

    def allgather(self, value):
        if value == self.machines[self.rank]:          # (this rank's machine id)
            return list(self.machines)
        return [value] * len(self.machines)


def test_the_cases_memory_is_counted_per_machine_against_what_it_has(tmp_path, monkeypatch):
    from mpigrad.bench import memory
    monkeypatch.setattr(memory, "_machine", lambda: "a")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24684112 kB\nMemAvailable:   1048576 kB\n")
    assert memory.available_bytes(str(meminfo)) == 1 << 30
    meminfo.write_text("MemTotal:       24684112 kB\n")
    assert memory.available_bytes(str(meminfo)) is None
    assert memory.available_bytes(str(tmp_path / "none")) is None
    assert memory.machine_ranks(_OneMachine(["a", "b", "a"], rank=2)) == 2
    layout = 100 << 20
    # 2 ranks x (0.3 GB + 24 x 100 MiB) = 5.3 GB of mpigrad's cases, then 2 ranks x
    # (1.4 GB + 16 x 100 MiB) = 5.9 GB of the peers' beside them, against 10 GB
    monkeypatch.setattr(memory, "available_bytes", lambda: 10 << 30)
    budget = memory.Budget(_OneMachine(["a", "a"]), layout)
    assert budget.ranks == 2 and budget.take(memory.CORE) is None
    assert budget.take(memory.PEERS) == (
        "the peers' cases (torch gloo, DDP, FSDP2; Horovod) need about 5.9 GB on a machine "
        "(2 rank(s) x 3.0 GB for this layout of 100.0 MiB), beside the 5.3 GB of the cases "
        "before them, which has 10.0 GB available")
    assert budget.take(memory.FACES) is None           # 2 x 1.6 GB: it fits beside the first
    assert budget.taken == 2 * (memory.CORE.per_rank(layout) + memory.FACES.per_rank(layout))
    monkeypatch.setattr(memory, "available_bytes", lambda: None)      # not Linux
    assert memory.Budget(_OneMachine(["a", "a"]), 1 << 40).take(memory.CORE) is None


def _bench_with_available(tmp_path, available, *args):
    """The bench on 2 ranks as if its machine had ``available`` bytes free."""
    mpiexec = mpiexec_path()
    if mpiexec is None:
        pytest.skip("mpiexec not found")
    script = tmp_path / "bench.py"
    script.write_text("import sys\nfrom mpigrad.bench import memory\n"
                      f"memory.available_bytes = lambda: {available}\n"
                      "from mpigrad.bench.__main__ import main\nsys.exit(main())\n")
    return subprocess.run([mpiexec, "-n", "2", sys.executable, str(script), "--layout",
                           "small", "--repeats", "1", "--warmup", "0", "--backward-ms", "0",
                           "--no-faces", "--details", *args],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=RUN_SECONDS, env={**os.environ, "PYTHONWARNINGS": "ignore"})


def test_a_layout_too_large_for_the_machine_is_refused_before_anything_runs(tmp_path):
    proc = _bench_with_available(tmp_path, 100 << 20)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert re.search(r"mpigrad's cases need about 0\.6 GB on a machine \(2 rank\(s\) x 0\.3 "
                     r"GB for this layout of 1\.0 MiB\), which has 0\.1 GB available: not "
                     r"run", proc.stderr), proc.stderr


def test_peers_that_do_not_fit_are_skipped_and_said_so(tmp_path):
    pytest.importorskip("torch")
    proc = _bench_with_available(tmp_path, 1 << 30)       # mpigrad's cases fit, torch's not
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the peers' cases (torch gloo, DDP, FSDP2; Horovod) need about 2.8 GB on a " \
        "machine (2 rank(s) x 1.4 GB for this layout of 1.0 MiB), beside the 0.6 GB" in proc.stdout
    assert "skipped (a smaller --layout, fewer ranks per machine, or --no-peers)" in proc.stdout
    assert "gloo" not in proc.stdout.replace("(torch gloo,", "")
    assert "result verified on every rank: yes" in proc.stdout


def test_bench_help_describes_every_option_with_its_default():
    proc = subprocess.run([sys.executable, "-m", "mpigrad.bench", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    for option in ("--dtype", "--repeats", "--warmup", "--bucket-bytes", "--format",
                   "--targets", "--layout"):
        assert option in text
    assert text.count("(default:") >= 8
    # one default each, none that reads backwards or shows a None
    assert "(default: True)" not in text and "(default: None)" not in text
    bucket = text[text.index("--bucket-bytes BYTES the"):text.index("--backward-ms MS ")]
    assert bucket.count("default") == 1


def test_bench_plot_without_matplotlib_fails_before_the_sweep(tmp_path):
    from mpigrad.bench.report import check_plotting
    import importlib.util
    if importlib.util.find_spec("matplotlib") is not None:
        assert check_plotting() is None
        return
    proc = subprocess.run([sys.executable, "-m", "mpi4py", "-m", "mpigrad.bench", "--sweep",
                           "bucket", "--plot", str(tmp_path / "p.png")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "pip install matplotlib" in proc.stderr
    assert "sweep bucket" not in proc.stdout           # nothing was timed


def test_bench_json_half_precision_and_sum():
    doc = json.loads(bench("--layout", "small", "--dtype", "bfloat16", "--sum",
                           "--backward-ms", "0", "--no-peers", "--no-faces", "--format", "json"))
    assert doc["verified"] and not doc["mean"] and doc["dtype"] == "bfloat16"
    assert {c["case"] for c in doc["cases"]} >= {"mpigrad reduce", "mpi floor",
                                                 "mpigrad inplace, mean",
                                                 "mpigrad reduce, float32 gradients"}
    named = {r["ratio"]: r for r in doc["ratios"]}
    assert "bfloat16 reduce / float32 reduce" in named
    # --no-faces: no framework's case, and the note says so
    assert not [c for c in doc["cases"] if c["case"].startswith(("torch", "mpigrad.jax",
                                                                 "mpigrad.horovod"))]
    assert "--no-faces: the frameworks' cases skipped" in doc["notes"]
    assert "per-tensor loop / reduce" not in named      # MPI has no bfloat16 Allreduce
    assert any(r["target"] is not None and r["met"] in (True, False) for r in doc["ratios"])
    # the half-precision kernels timed beside memcpy, named; the device route said
    assert doc["casts"]["kernels"].split()[0] in ("C", "numba")
    assert set(doc["casts"]["gb_per_s"]) == {
        "memcpy float32", "float16 -> float32", "float32 -> float16", "float32 -> bfloat16",
        "float32 += float16", "float16 + float16 -> float16 (mean, check)",
        "bfloat16 + bfloat16 -> bfloat16 (mean, check)"} \
        and min(doc["casts"]["gb_per_s"].values()) > 0
    assert doc["device_route"].startswith("device arrays: staged through host memory")


def test_bench_sparse_and_sweep_csv():
    assert "result verified on every rank: yes" in bench("--sparse-rows", "50", "--no-peers")
    rows = bench("--sweep", "message", "--format", "csv").splitlines()
    assert rows[0] == "message bytes,case,min_ms,median_ms" and len(rows) > 10


def test_tune_prints_the_best_settings_and_their_gain():
    out = bench("--layout", "small", "--tune")
    assert "tune: layout small" in out and "bucket_bytes:" in out and "chunk_bytes" in out
    best = [line for line in out.splitlines() if line.startswith("best: ")]
    assert len(best) == 1 and "the speed of the defaults" in best[0]
    exports = [line for line in out.splitlines() if line.startswith("export MPIGRAD_")]
    assert exports == [] and "no export needed" in out or len(exports) == 2


def test_bench_over_the_tcp_transport_on_loopback():
    out = bench("--layout", "small", "--backward-ms", "0", "--no-peers", "--no-faces",
                "--transport", "tcp")
    assert "transport tcp on loopback" in out
    assert "FI_TCP_IFACE=lo" in out or "btl_tcp_if_include=lo" in out
    assert "result verified on every rank: yes" in out


def test_transport_switches_known_per_library():
    from mpigrad.bench.transport import _TCP, _library
    assert _library("MPICH Version:      5.0.2") == "MPICH"
    assert _library("Open MPI v5.0.11, package: Open MPI") == "Open MPI"
    assert _library("Intel(R) MPI Library 2021") is None
    # test traffic stays on the loopback interface
    assert _TCP["MPICH"]["FI_TCP_IFACE"] == "lo"
    assert _TCP["Open MPI"]["OMPI_MCA_btl_tcp_if_include"] == "lo"


def test_scaling_mode_counts_per_rank_and_verifies_every_rank_count():
    """--scaling runs a job per rank count (it launches them: no mpiexec around it)."""
    if mpiexec_path() is None:
        pytest.skip("mpiexec not found")
    proc = subprocess.run([sys.executable, "-m", "mpigrad.bench", "--scaling", "2,3"],
                          capture_output=True, text=True, timeout=RUN_SECONDS, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {int(line.split()[0]): line.split() for line in proc.stdout.splitlines()
            if re.match(r"\s+\d+\s+1 node x", line)}
    assert sorted(rows) == [2, 3], proc.stdout
    for ranks, row in rows.items():
        assert row[-1] == "yes", proc.stdout                # the mean of 1..p on every rank
        notices = float(row[row.index("mean,") - 1])
        assert 0 < notices <= 2, proc.stdout                # 2 ceil(log2 p) per Reducer


def test_the_readmes_first_snippet_is_the_call_the_bench_recommends():
    """Where zero-copy is fastest (as on this project's machines), the bench
    names it with its pattern, and the README's first python snippet is that
    pattern; each call the bench may name has a pattern."""
    import pathlib
    import re
    from mpigrad.bench.report import _CALLS, PATTERNS, render
    result = fake_result(spread=1.2, **{"mpigrad_reduce": 22.0, "mpigrad_reduce_inplace": 21.0,
                                        "mpigrad_zero-copy": 11.0, "per-tensor_Allreduce": 25.0})
    out = render(result)
    pattern = PATTERNS["mpigrad zero-copy"]
    assert "the call to pick here: zero-copy: bucket_views" in out
    assert "; then each step: ".join(pattern) in out
    readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    first = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    lines = [line.split("#")[0].strip() for line in first.splitlines()]
    assert all(step in lines for step in pattern), first
    assert lines.index(pattern[0]) < lines.index(pattern[1])
    assert {case for case, _ in _CALLS} == set(PATTERNS)


def test_the_bench_says_what_it_does_at_least_every_interval_on_the_wall_clock(
        monkeypatch, capsys):
    """A line as each phase begins, and again at least every EVERY seconds
    while it goes on, its time the wall clock's since the benchmark began."""
    import time
    from mpigrad.bench import progress
    monkeypatch.setattr(progress, "EVERY", 1.0)
    status = progress.Status()
    status.begin(0)
    time.sleep(1.2)                       # the benchmark's own work before the first phase
    status.say("timing")
    time.sleep(3.5)                       # one long case: silent but for the ticker
    status.end()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "mpigrad-bench: starting (1 s)", lines        # silent no longer
    timing = lines[lines.index("mpigrad-bench: timing (1 s)"):]
    assert len(timing) >= 3 and all(line.startswith("mpigrad-bench: timing (") for line in timing)
    seconds = [int(line.rsplit("(", 1)[1].split()[0]) for line in lines]
    assert seconds == sorted(seconds) and seconds[-1] >= 4


def test_no_printed_ratio_contradicts_the_docs():
    """A ratio below 1 is "slower", never "0.92x faster"; a call that reads
    below its floor (which no call beats: docs/benchmark.md) says it is within
    the run's noise of it."""
    from mpigrad.bench.report import _speed, render
    result = fake_result(spread=1.1, **{
        "mpigrad_reduce": 22.0, "mpigrad_reduce_inplace": 21.0, "mpigrad_zero-copy": 7.9,
        "shared-bucket_floor": 8.0, "copy_floor": 11.5, "mpi_floor": 12.0,
        "per-tensor_Allreduce": 25.0})
    result["node_ranks"] = 2
    out = render(result, details=True)
    assert "zero-copy: bucket_views 0.99x (within noise of the floor)" in out
    assert _speed(96.5, 104.3) == "1.08x slower" and _speed(104.3, 96.5) == "1.08x faster"
