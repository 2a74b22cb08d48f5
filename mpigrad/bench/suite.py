"""The benchmark cases: mpigrad's reduce against per-tensor MPI and the floors."""

import math
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from .._base.bfloat16 import dtype_named, is_bfloat16
from .._base.dtypes import wire_dtype
from .casts import measure_casts
from .._collective.device import device_support
from ..reducer import Reducer
from .._base.row_sparse import RowSparse
from .._engine.world import fault_tolerant
from .faces import face_cases
from .layouts import load_layout
from .memory import CORE, FACES, PEERS, Budget, NotEnoughMemory
from .link import link_floor_case
from .optimizer import optimizer_cases
from .peers import SMALL_CALLS, peer_cases
from .progress import status
from .timing import time_interleaved
from .verify import expected, fill, verify_cases

__all__ = ["run_suite", "run_sparse_suite", "mpi_floor_chunk"]

_CHUNK_SWEEP = [256 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20, 64 << 20]


def _mpi_datatype(dtype):
    """MPI's predefined datatype of a numpy dtype (the baselines' own calls)."""
    return MPI.Datatype.fromcode(np.dtype(dtype).char)


def _allreduce_chunks(comm, buf, chunk_elems):
    datatype = _mpi_datatype(buf.dtype)
    for start in range(0, buf.size, chunk_elems):
        comm.Allreduce(MPI.IN_PLACE, [buf[start:start + chunk_elems], datatype], MPI.SUM)


def mpi_floor_chunk(comm, buf, repeats=3):
    """The chunk size (bytes) at which a pre-packed buffer reduces fastest.

    Sweeps 256 KiB up to the whole buffer; returns (chunk_bytes, {chunk: seconds}).
    """
    sizes = sorted({min(c, buf.nbytes) for c in _CHUNK_SWEEP} | {buf.nbytes})
    cases = {c: (lambda c=c: _allreduce_chunks(comm, buf, max(1, c // buf.itemsize)))
             for c in sizes}
    timings = time_interleaved(comm, cases, repeats, warmup=1)
    best = min(sizes, key=lambda c: timings[c].min)
    return best, {c: timings[c].min for c in sizes}


def _shared_sum_floor(flat, parts):
    """The least memory traffic of a sum in node-shared buckets, as a case:
    ``parts`` slices of ``flat`` (N/parts elements each) summed into one
    slice's room, in cache-sized pieces (reads N, writes N/parts)."""
    rows = flat[:flat.size // parts * parts].reshape(parts, -1)
    out = np.empty(rows.shape[1], flat.dtype)
    piece = max(1, (1 << 20) // flat.itemsize)

    def run():
        for lo in range(0, out.size, piece):
            acc = out[lo:lo + piece]
            np.add(rows[0, lo:lo + piece], rows[1, lo:lo + piece], out=acc)
            for row in rows[2:]:
                np.add(acc, row[lo:lo + piece], out=acc)
    return run


_WORK = np.ones(1 << 14, np.float32)     # 64 KiB: one kernel call is a few microseconds


def _spin(seconds):
    """Busy CPU work standing in for backward compute: native kernels (numpy's), which
    release the GIL between the Python lines that call them, as torch's autograd does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        np.sqrt(_WORK, out=_WORK)


def _overlap_cases(reducer, grads, backward):
    """A simulated backward (compute shared by gradient size, last gradient
    first) alone, followed by reduce, and overlapped with start/ready/wait."""
    sizes = [g.size for g in grads]
    total = sum(sizes) or 1
    shares = [backward * n / total for n in sizes]
    order = range(len(grads) - 1, -1, -1)

    def backward_only():
        for i in order:
            _spin(shares[i])

    def backward_then_reduce():
        backward_only()
        return reducer.reduce(grads, inplace=True)

    def overlapped():
        handle = reducer.start(grads)
        for i in order:
            _spin(shares[i])
            handle.ready(i)
        return handle.wait()

    return {"backward only": backward_only}, {"backward then reduce": backward_then_reduce,
                                              "backward overlapped": overlapped}


def _node_memory_cases(args, mean, grads, work, cases, inputs):
    """Where the Reducer can sum on the node, add to ``cases`` its plain
    reduce and zero-copy through MPI (shared_memory=False), and its plain
    and in-place reduces without cross-memory sums (cross_memory=False: a
    plain reduce packed into the shared buckets, a packed in-place one
    through MPI with MPICH), beside the defaults' cases; their inputs go to
    ``inputs``. Returns what was made (None where node sums cannot be had)."""
    node = Reducer(bucket_bytes=args.bucket_bytes, mean=mean, shared_memory="auto")
    if not node.uses_shared_memory:
        node.free()
        return None
    cross = node.uses_cross_memory
    node.free()
    plain = Reducer(bucket_bytes=args.bucket_bytes, mean=mean, shared_memory=False)
    zero_copy = Reducer(bucket_bytes=args.bucket_bytes, mean=mean, shared_memory=False)
    own = [g.copy() for g in grads]
    views = zero_copy.bucket_views(grads)
    for view, grad in zip(views, grads):
        view[...] = grad
    cases["mpigrad reduce, MPI"] = lambda: plain.reduce(own)
    cases["mpigrad zero-copy, MPI"] = lambda: zero_copy.reduce(views, inplace=True)
    made = {"mpigrad reduce, MPI": plain, "mpigrad zero-copy, MPI": zero_copy}
    if cross:
        segments = Reducer(bucket_bytes=args.bucket_bytes, mean=mean, cross_memory=False)
        cases["mpigrad reduce, no cross-memory"] = lambda: segments.reduce(own)
        cases["mpigrad inplace, no cross-memory"] = lambda: segments.reduce(work, inplace=True)
        made["mpigrad reduce, no cross-memory"] = made["mpigrad inplace, no cross-memory"] = \
            segments
    inputs += [own, views]
    return {"grads": own, "views": views, "reducers": made}


def _sharded_cases(args, mean, grads, cases):
    """Add to ``cases`` a sharded step's communication, reduce_scatter and
    allgather_shards together (its results, the full mean, verified like the
    others); return the Reducer it made and each half as a case of its own
    (their results are shards: verified through the pair)."""
    sharded = Reducer(bucket_bytes=args.bucket_bytes, mean=mean)
    shards = sharded.reduce_scatter(grads)
    full = [np.empty_like(g) for g in grads]
    cases["mpigrad reduce_scatter + allgather_shards"] = \
        lambda: sharded.allgather_shards(sharded.reduce_scatter(grads), into=full)
    return sharded, {"mpigrad reduce_scatter": lambda: sharded.reduce_scatter(grads),
                     "mpigrad allgather_shards":
                         lambda: sharded.allgather_shards(shards, into=full)}


def _recording(case, reducer, name, backends, measured):
    """``case``, noting in ``backends[name]`` what summed its reducer's call
    and in ``measured[name]`` the times that chose it (Reducer.measured)."""
    def run():
        out = case()
        backends[name] = reducer.backend
        if reducer.measured:
            measured[name] = reducer.measured
        return out
    return run


def _prepare_inputs(cases, inputs):
    """Per case, a function that writes its input arrays afresh (from a copy
    of their values now); ``inputs`` maps tuples of case names to arrays, each case
    in one tuple at most."""
    named = [name for names in inputs for name in names]
    twice = sorted({name for name in named if named.count(name) > 1})
    if twice:
        raise ValueError(f"_prepare_inputs: expecting each case's inputs once, got {twice} "
                         "in more than one group (the last would overwrite the others)")
    prepare = {}
    for names, arrays in inputs.items():
        if not arrays:
            continue
        sources = [np.copy(a) for a in arrays]

        def rewrite(arrays=arrays, sources=sources):
            for array, source in zip(arrays, sources):
                np.copyto(array, source)
        prepare.update((name, rewrite) for name in names if name in cases)
    return prepare


#: calls that settle a Reducer's measured choice of its path (Reducer.measured), at most
SETTLING_CALLS = 16


def _settle_choices(cases, prepare, reducers):
    """Call each case of ``reducers`` (name -> its Reducer) until its Reducer has
    measured its paths and kept one (or SETTLING_CALLS calls), so that every
    timed call takes the path the Reducer keeps (the same calls on every rank)."""
    for name, reducer in reducers.items():
        for _ in range(SETTLING_CALLS):
            if reducer.measured or name not in cases:
                break
            if name in prepare:
                prepare[name]()
            cases[name]()


#: the many small tensors of one call
MANY = (1000, 256)


def _small_call_cases(comm, mean):
    """A small call's cost against MPI's own: ``SMALL_CALLS`` allreduces of 1 KiB
    through mpigrad.allreduce and through mpi4py's Allreduce, and 1000 tensors
    of 256 float32 in one reduce against a per-tensor Allreduce loop (zeros:
    the sums stay put round after round); the Reducer made, to free."""
    from ..collectives import allreduce
    one = np.zeros(256, np.float32)
    many = [np.zeros(MANY[1], np.float32) for _ in range(MANY[0])]
    reducer = Reducer(mean=mean)

    def raw():
        for _ in range(SMALL_CALLS):
            comm.Allreduce(MPI.IN_PLACE, one, MPI.SUM)

    def mine():
        for _ in range(SMALL_CALLS):
            allreduce(one, op="sum")

    def loop():
        for g in many:
            comm.Allreduce(MPI.IN_PLACE, g, MPI.SUM)
    return {f"MPI Allreduce 1 KiB x {SMALL_CALLS}": raw,
            f"mpigrad.allreduce 1 KiB x {SMALL_CALLS}": mine,
            "per-tensor Allreduce 1000 x 256": loop,
            "mpigrad reduce 1000 x 256": lambda: reducer.reduce(many, inplace=True)}, reducer


def _fill(shapes, dtype, rank):
    return [np.full(s, rank + 1, dtype) for s in shapes]


def run_suite(comm, args):
    """Time every case on the layout; return a dict for the report."""
    status.say(f"setting up: the {args.layout} layout, its Reducers, the MPI floor's chunks")
    shapes = load_layout(args.layout)
    dtype = dtype_named(args.dtype)
    elements = sum(math.prod(s) for s in shapes)
    budget = Budget(comm, elements * wire_dtype(dtype).itemsize)
    problem = budget.take(CORE)
    if problem:
        raise NotEnoughMemory(f"{problem}: not run, the kernel would end it (a smaller "
                              "--layout, or fewer ranks per machine)")
    grads = _fill(shapes, dtype, comm.rank)
    mean = not args.sum                 # the Reducer's default unless --sum
    reducer = Reducer(bucket_bytes=args.bucket_bytes, mean=mean)
    wire = reducer.plan(grads).buckets[0].dtype
    flat = np.ones(elements, wire)
    chunk, chunk_sweep = mpi_floor_chunk(comm, flat)
    copy_src = np.ones(elements, wire)
    datatype = _mpi_datatype(dtype) if not is_bfloat16(dtype) else None

    def per_tensor():
        for g in work:
            comm.Allreduce(MPI.IN_PLACE, [g, datatype], MPI.SUM)

    work = _fill(shapes, dtype, comm.rank)
    unchecked = Reducer(bucket_bytes=args.bucket_bytes, mean=mean, check=False)
    unwatched = Reducer(bucket_bytes=args.bucket_bytes, mean=mean, timeout=None)
    finite = Reducer(bucket_bytes=args.bucket_bytes, mean=mean, check_finite=True)
    bf16_wire = Reducer(bucket_bytes=args.bucket_bytes, mean=mean, wire="bfloat16")
    # the in-place case gets a reducer of its own, as the check-off and
    # watchdog-off cases do, so that their ratios compare like with like
    inplace = Reducer(bucket_bytes=args.bucket_bytes, mean=mean)
    other = Reducer(bucket_bytes=args.bucket_bytes, mean=not mean)
    exact = Reducer(bucket_bytes=args.bucket_bytes, mean=mean, reproducible=True)
    # zero-copy on a reducer of its own: "auto" sums a plain reduce of a
    # signature whose bucket views were handed out through MPI
    zero_copy = Reducer(bucket_bytes=args.bucket_bytes, mean=mean)
    views = zero_copy.bucket_views(grads)
    for view, grad in zip(views, grads):
        view[...] = grad
    # node sums ride on the check's agreement, so check=False sums through
    # MPI: the check's cost is read against a checked call through MPI
    through_mpi = Reducer(bucket_bytes=args.bucket_bytes, mean=mean, shared_memory=False)
    mine = {    # mpigrad's cases: each returns its results, to be verified
        "mpigrad reduce": lambda: reducer.reduce(grads),
        "mpigrad reduce inplace": lambda: inplace.reduce(work, inplace=True),
        "mpigrad zero-copy": lambda: zero_copy.reduce(views, inplace=True),
        "mpigrad inplace, MPI": lambda: through_mpi.reduce(work, inplace=True),
        "mpigrad inplace, check off": lambda: unchecked.reduce(work, inplace=True),
        "mpigrad inplace, watchdog off": lambda: unwatched.reduce(work, inplace=True),
        "mpigrad inplace, check_finite": lambda: finite.reduce(work, inplace=True),
        "mpigrad inplace, bf16 wire": lambda: bf16_wire.reduce(work, inplace=True),
    }
    # the other of mean and sum, verified against its own reference below
    flipped = {f"mpigrad inplace, {'sum' if mean else 'mean'}":
               lambda: other.reduce(work, inplace=True)}
    # exact sums: the mean divides once, verified against its own reference
    reproducible = {"mpigrad inplace, reproducible": lambda: exact.reduce(work, inplace=True)}
    inputs, grads32, as_float32 = [grads, work, views], None, {}
    survivors = ()
    if fault_tolerant():          # launched with fault tolerance: the private-memory mode
        survivors = (Reducer(bucket_bytes=args.bucket_bytes, mean=mean, on_failure="shrink"),)
        mine["mpigrad inplace, on_failure=shrink"] = \
            lambda: survivors[0].reduce(work, inplace=True)
    node = _node_memory_cases(args, mean, grads, work, mine, inputs)
    sharded, halves = _sharded_cases(args, mean, grads, mine) if args.sharded else (None, {})
    if dtype != np.float32:       # the cost of the dtype: the same layout in float32
        grads32 = _fill(shapes, np.float32, comm.rank)
        inputs.append(grads32)
        as_float32["mpigrad reduce, float32 gradients"] = lambda: reducer.reduce(grads32)
    cases = {
        "mpi floor": lambda: _allreduce_chunks(comm, flat, max(1, chunk // wire.itemsize)),
        "copy floor": lambda: np.copyto(flat, copy_src),
    }
    node_ranks = _node_ranks(comm)
    if node_ranks > 1:
        cases["shared-bucket floor"] = _shared_sum_floor(copy_src, node_ranks)
    link_floor, nodes = link_floor_case(comm, elements * wire.itemsize)
    if link_floor is not None:
        cases["link floor"] = link_floor
    if args.backward_ms:
        plain, overlapped = _overlap_cases(reducer, work, args.backward_ms / 1e3)
        cases.update(plain)
        mine.update(overlapped)
    # which sum backend each of mpigrad's reduce cases takes
    backends, measured = {}, {}
    took = {"mpigrad reduce": reducer, "mpigrad reduce inplace": inplace,
            "mpigrad zero-copy": zero_copy, "backward overlapped": reducer,
            **(node["reducers"] if node else {})}
    for name, r in took.items():
        if name in mine:
            mine[name] = _recording(mine[name], r, name, backends, measured)
    cases = {**mine, **flipped, **as_float32, **reproducible, **halves, **cases}
    early = {}
    if args.backward_ms and args.peers:
        # timed before torch's peers are set up in this process: beside a gloo process
        # group and a DDP model, overlap across 2 nodes hid 19-30% where it hid 67%
        # alone (ResNet-50, 2 x 2 ranks, 2 Gbit/s; not found why)
        overlap = ("backward only", "backward then reduce", "backward overlapped")
        early = time_interleaved(comm, {name: cases.pop(name) for name in overlap},
                                 args.repeats, warmup=args.warmup,
                                 prepare=_prepare_inputs(overlap, {overlap[1:]: work}),
                                 label="timing the overlap cases")
    notes = []
    peers_fit = _fits(budget, PEERS, args.peers and dtype == np.float32, "--no-peers", notes)
    if peers_fit:
        status.say("setting up the peers (torch's gloo, DDP, FSDP2; Horovod), where installed")
    peers, peer_notes = peer_cases(comm, shapes, dtype) if peers_fit else ({}, [])
    notes += peer_notes
    if early:
        notes.append("the overlap cases were timed apart, before the torch baselines were "
                     "set up in the process")
    if "torch" in sys.modules and dtype.itemsize == 2:
        notes.append("torch is imported: half-precision casts use its kernels")
    if dtype.itemsize == 2:
        notes.append(f"{args.dtype} gradients travel as float32: they cannot live in the "
                     "float32 buckets, so zero-copy packs and casts them like any other call "
                     "(its speed is that of a float32 layout's zero-copy only for "
                     "float32 gradients)")
    cases.update(peers)
    if _fits(budget, FACES, args.faces, "--no-faces", notes):
        faces, face_references, face_notes = face_cases(shapes, dtype, mean, comm.size,
                                                        comm.rank)
        steps, step_notes, free_steps = optimizer_cases(shapes, dtype, args.bucket_bytes,
                                                        mean, args.sharded)
    else:
        faces, face_references, steps, free_steps = {}, {}, {}, lambda: None
        face_notes = [] if args.faces else ["--no-faces: the frameworks' cases skipped"]
        step_notes = []
    cases.update(faces)
    notes += face_notes
    cases.update(steps)
    small_calls, small_reducer = _small_call_cases(comm, mean)
    cases.update(small_calls)
    notes += step_notes
    if datatype is not None:
        cases["per-tensor Allreduce"] = per_tensor
    else:
        notes.append("per-tensor Allreduce skipped: MPI has no bfloat16 datatype")
    prepare = _prepare_inputs(cases, {
        ("mpigrad reduce, MPI", "mpigrad reduce, no cross-memory"): node and node["grads"],
        ("mpigrad zero-copy, MPI",): node and node["views"],
        ("mpigrad reduce",): grads, ("mpigrad zero-copy",): views,
        ("mpigrad reduce, float32 gradients",): grads32,
        ("mpi floor",): [flat], ("copy floor", "shared-bucket floor"): [copy_src],
        ("mpigrad reduce inplace", "mpigrad inplace, check off", "mpigrad inplace, watchdog off",
         "mpigrad inplace, no cross-memory",
         "mpigrad inplace, on_failure=shrink", "mpigrad inplace, MPI",
         "mpigrad inplace, check_finite", "mpigrad inplace, bf16 wire",
         "backward then reduce", "backward overlapped", "per-tensor Allreduce",
         *flipped, *reproducible): work})
    _settle_choices(cases, prepare, {"mpigrad reduce": reducer, "mpigrad reduce inplace": inplace})
    timings = {**early, **time_interleaved(comm, cases, args.repeats, warmup=args.warmup,
                                           prepare=prepare, label=f"timing {len(cases)} cases")}

    def refill():
        for arrays in inputs:
            fill(arrays, comm.rank)
    status.say("verifying every case's results against the reference")
    failed = verify_cases(comm, mine, refill, expected(shapes, dtype, comm.size, mean))
    notes.append("backends: " + "; ".join(f"{name}: {backend}"
                                           for name, backend in backends.items()))
    notes += [f"{name}: {backends[name]} measured faster over the first calls ("
              + ", ".join(f"{b} {ms:.1f} ms" for b, ms in times.items()) + ")"
              for name, times in measured.items()]
    failed += verify_cases(comm, flipped, refill, expected(shapes, dtype, comm.size, not mean))
    failed += verify_cases(comm, as_float32, refill,
                           expected(shapes, np.float32, comm.size, mean))
    failed += verify_cases(comm, reproducible, refill,
                           expected(shapes, dtype, comm.size, mean, exact=True))
    for name, (want, arrays) in face_references.items():
        inputs.append(arrays)
        failed += verify_cases(comm, {name: faces[name]}, refill, want)
    notes += [f"{name}: results differ from the reference" for name in failed]
    status.say("timing the half-precision kernels beside a memory copy")
    casts = measure_casts()
    # in one order on every rank (a set's follows each process's addresses), each once
    for r in dict.fromkeys([reducer, unchecked, unwatched, finite, bf16_wire, inplace, other,
                            exact, zero_copy, through_mpi,
                            *(node["reducers"].values() if node else ()), *survivors,
                            small_reducer, *((sharded,) if sharded else ())]):
        r.free()
    free_steps()
    return {
        "layout": args.layout, "dtype": args.dtype, "tensors": len(shapes),
        "elements": elements, "wire_bytes": elements * wire.itemsize,
        "ranks": comm.size, "thread_level": _thread_level(), "mean": mean,
        "mpi": MPI.Get_library_version().splitlines()[0].strip(),
        "floor_chunk_bytes": chunk, "chunk_sweep": chunk_sweep,
        "timings": timings, "verified": not failed, "notes": notes,
        "transport_kind": args.transport, "cores": os.cpu_count(),
        "node_ranks": node_ranks, "backends": backends, "measured": measured, "nodes": nodes,
        "link": os.environ.get("MPIGRAD_CLUSTER_LINK") or None,
        "backward_ms": args.backward_ms, "casts": casts,
        "device_route": device_support().route(),
    }


def _fits(budget, cases, asked, flag, notes):
    """Whether ``cases`` (``asked`` for) fit the machines' memory (collective
    where asked for); a note of what they need where they do not."""
    problem = budget.take(cases) if asked else None
    if problem:
        notes.append(f"{problem}: skipped (a smaller --layout, fewer ranks per machine, or "
                     f"{flag})")
    return asked and problem is None


def _node_ranks(comm):
    """How many ranks share this rank's node."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    size = node.Get_size()
    node.Free()
    return size


def _thread_level():
    names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
             MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    return names[MPI.Query_thread()]


def run_sparse_suite(comm, args, vocab=30522, width=768):
    """Time a BERT-vocabulary embedding gradient with ``args.sparse_rows`` rows
    per rank, reduced by Allgatherv against densify-and-allreduce."""
    rng = np.random.default_rng(comm.rank)
    dtype = dtype_named(args.dtype)
    k = args.sparse_rows
    grad = RowSparse(rng.integers(0, vocab, k), np.ones((k, width), dtype), (vocab, width))
    reducers = {mode: Reducer(sparse=mode, mean=not args.sum)
                for mode in ("gather", "dense", "auto")}
    cases = {f"sparse {mode}": (lambda r=r: r.reduce([grad])) for mode, r in reducers.items()}
    timings = time_interleaved(comm, cases, args.repeats, warmup=args.warmup)
    gathered = reducers["gather"].reduce([grad])[0].to_dense()
    densified = reducers["dense"].reduce([grad])[0].to_dense()
    verified = comm.allreduce(bool(np.array_equal(gathered, densified)), op=MPI.LAND)
    for r in reducers.values():
        r.free()
    wire = np.dtype(np.float32) if dtype.itemsize < 4 else dtype
    return {
        "layout": f"embedding {vocab}x{width}, {k} rows per rank", "dtype": args.dtype,
        "tensors": 1, "elements": vocab * width, "wire_bytes": vocab * width * wire.itemsize,
        "ranks": comm.size, "thread_level": _thread_level(), "mean": not args.sum,
        "mpi": MPI.Get_library_version().splitlines()[0].strip(),
        "floor_chunk_bytes": 0, "chunk_sweep": {}, "timings": timings,
        "verified": verified, "notes": ["algbw counts the dense table's bytes"],
    }
