"""mpigrad-bench: time mpigrad against per-tensor MPI, its peers and the floors.

Run under MPI, e.g. ``mpiexec -n 2 mpigrad-bench --layout resnet50``; rank 0 prints.
MPI is initialised when mpigrad is imported, so the thread level is chosen with
mpi4py's environment variable: ``MPI4PY_RC_THREAD_LEVEL=serialized``.
"""

import argparse
import os
import sys

__all__ = ["main"]

DTYPES = ("float32", "float16", "bfloat16", "float64")


def _parse(argv):
    p = argparse.ArgumentParser(
        prog="mpigrad-bench",
        description="Time mpigrad's reductions of a model's gradients against what one "
                    "would use otherwise (a per-tensor Allreduce loop, MPI's Allreduce of one "
                    "packed buffer, a memory copy, torch gloo/DDP and Horovod when installed), "
                    "in the same run; verify every result. Run under MPI: mpiexec -n 2 "
                    "mpigrad-bench. Rank 0 prints.")
    p.add_argument("--layout", default="resnet50",
                   help="the gradients' shapes: resnet50, bert_base, gpt2_small, small "
                        "(1000 x 256), or a JSON file of shapes (default: resnet50)")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="the gradients' dtype; half precision travels as float32 "
                        "(default: float32)")
    p.add_argument("--repeats", type=int, default=10,
                   help="timed rounds; every round runs every case once, interleaved "
                        "(default: 10)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed rounds first (default: 2)")
    p.add_argument("--bucket-bytes", type=int, default=None, metavar="BYTES",
                   help="the Reducers' bucket_bytes (default: the Reducer's: "
                        "MPIGRAD_BUCKET_BYTES, else 1 MiB)")
    p.add_argument("--backward-ms", type=float, default=40.0, metavar="MS",
                   help="simulated backward compute for the overlap cases; 0 skips them "
                        "(default: 40)")
    p.add_argument("--torch-casts", action="store_true",
                   help="import torch first (half-precision casts use its kernels "
                        "where mpigrad's C kernels could not be built)")
    p.add_argument("--no-peers", dest="peers", action="store_false",
                   help="skip the torch gloo/DDP and Horovod baselines (without it they "
                        "run wherever installed)")
    p.add_argument("--no-faces", dest="faces", action="store_false",
                   help="skip the frameworks' cases: torch's optimizers, the Horovod and "
                        "jax faces (without it they run wherever installed)")
    p.add_argument("--sparse-rows", type=int, default=None, metavar="K",
                   help="instead of a layout, time a 30522x768 embedding gradient with K "
                        "rows per rank: gather vs dense")
    p.add_argument("--sweep", choices=("bucket", "chunk", "tensors", "message"),
                   help="instead of the comparison, time against one size")
    p.add_argument("--tune", action="store_true",
                   help="instead of the comparison, find the bucket_bytes and chunk_bytes "
                        "that reduce the layout fastest here; prints the export lines")
    p.add_argument("--plot", metavar="FILE.png",
                   help="with --sweep: plot time against size (needs matplotlib)")
    p.add_argument("--format", default="table", choices=("table", "csv", "json"),
                   help="output format; csv and json carry every case, ratio and target "
                        "(default: table)")
    p.add_argument("--details", action="store_true",
                   help="also print the floors, every case timed and the notes")
    p.add_argument("--targets", action="store_true",
                   help="also print the ratios this project's speed targets are stated in, "
                        "each marked met or MISSED (for developers and CI)")
    p.add_argument("--transport", default="shm", choices=("shm", "tcp"),
                   help="shm: the MPI library's default; tcp: its TCP network path on the "
                        "loopback interface (cluster-like latency on one machine) "
                        "(default: shm)")
    p.add_argument("--sharded", action="store_true",
                   help="also time reduce_scatter, allgather_shards and the two together "
                        "(a sharded step's communication; the round trip is verified)")
    p.add_argument("--sum", action="store_true",
                   help="time reducers with mean=False (default: the Reducer's defaults, "
                        "mean=True; the other is timed as an extra in-place case)")
    p.add_argument("--nodes", type=int, default=None, metavar="N",
                   help="run on N nodes made of namespaces on this machine (root; see "
                        "docs/cluster.md), --ppn ranks each, joined by a link of rate --link; "
                        "run it without mpiexec: it launches itself there")
    p.add_argument("--ppn", type=int, default=None,
                   help="with --nodes: ranks per node (default 2); with --scaling: place each "
                        "rank count on nodes of this many ranks (namespaces; root)")
    p.add_argument("--scaling", metavar="P,P,...",
                   help="instead of the comparison, per rank count: construction time, MPI "
                        "operations and agreements per call, exit time and notices, memory "
                        "per rank (run it without mpiexec: it launches each job)")
    p.add_argument("--link", default=None, metavar="RATE",
                   help="with --nodes: the link's rate in tc's syntax, e.g. 2gbit "
                        "(default: unlimited)")
    args = p.parse_args(argv)
    if args.link is not None and args.nodes is None:
        p.error("--link sets the link between nodes: add --nodes 2")
    if args.plot and not args.sweep:
        p.error("--plot draws a sweep: add --sweep bucket|chunk|tensors|message")
    return args


def main(argv=None):
    args = _parse(argv)
    if args.scaling:
        from .scaling import main as scaling_main
        return scaling_main([int(p) for p in args.scaling.split(",")], args.ppn)
    if args.nodes is not None and not os.environ.get("MPIGRAD_CLUSTER_HOSTS"):
        return _on_cluster(args, sys.argv[1:] if argv is None else list(argv))
    from .transport import start_mpi
    transport = start_mpi(args.transport)   # before MPI starts; MPI4PY_RC_THREAD_LEVEL
    import numpy as np
    from mpi4py import MPI
    if args.torch_casts:
        import torch  # noqa: F401  (mpigrad._engine.dtypes.assign uses it once imported)

    from .report import check_plotting, plot_sweep, render, render_sweep
    from .memory import NotEnoughMemory
    from .suite import run_sparse_suite, run_suite

    comm = MPI.COMM_WORLD
    problem = check_plotting() if args.plot else None    # before the sweep, not after
    if problem is None and comm.size < 2:
        problem = ("1 rank has nothing to compare (a collective of one rank moves no data): "
                   "run it on 2 ranks or more under MPI, e.g. mpiexec -n 2 mpigrad-bench")
    if problem:
        if comm.rank == 0:
            print(f"mpigrad-bench: {problem}", file=sys.stderr)
        return 2
    from .progress import status
    status.begin(comm.rank)
    status.say(f"{comm.size} ranks; the comparison takes about 1 minute here (2 minutes "
               "with torch installed: its peers)" if not (args.tune or args.sweep) else
               f"{comm.size} ranks")
    if args.tune:
        return _tune(comm, args, transport)
    if args.sweep:
        from .layouts import load_layout
        from .sweeps import run_sweep
        grads = [np.ones(s, np.float32) for s in load_layout(args.layout)]
        label, rows, failed = run_sweep(comm, grads, args)
        if comm.rank == 0:
            print(render_sweep(args, label, rows, args.format))
            if args.plot:
                plot_sweep(args, label, rows, args.plot)
            for name in failed:
                print(f"mpigrad-bench: {name}: results differ from the reference",
                      file=sys.stderr)
        return 1 if failed else 0
    suite = run_suite if args.sparse_rows is None else run_sparse_suite
    try:
        result = suite(comm, args)
    except NotEnoughMemory as exc:      # (agreed: raised on every rank)
        status.end()
        if comm.rank == 0:
            print(f"mpigrad-bench: {exc}", file=sys.stderr)
        return 2
    status.end()
    result["transport"] = transport
    if comm.rank == 0:
        print(render(result, args.format, targets=args.targets, details=args.details))
        sys.stdout.flush()
    return 0 if result["verified"] else 1


def _tune(comm, args, transport):
    import numpy as np
    from mpi4py import MPI

    from .layouts import load_layout
    from .report import library_label
    from .tune import render_tune, run_tune
    from .._base.bfloat16 import dtype_named
    grads = [np.ones(s, dtype_named(args.dtype)) for s in load_layout(args.layout)]
    result = run_tune(comm, grads, args)
    if comm.rank == 0:
        library = library_label(MPI.Get_library_version())
        print(render_tune(result, f"tune: layout {args.layout} ({args.dtype}), {comm.size} "
                                  f"ranks on {library}, transport {transport}"))
        for name in result["failed"]:
            print(f"mpigrad-bench: {name}: results differ from the reference", file=sys.stderr)
    return 1 if result["failed"] else 0


def _on_cluster(args, argv):
    """Run this benchmark on ``args.nodes`` nodes of namespaces (from outside MPI)."""
    from .cluster import main as cluster_main
    return cluster_main(["--nodes", str(args.nodes), "--ppn", str(args.ppn or 2),
                         *(["--link", args.link] if args.link else []),
                         "--", sys.executable, "-m", "mpigrad.bench", *argv])


if __name__ == "__main__":
    sys.exit(main())
