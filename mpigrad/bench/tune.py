"""--tune: the bucket cap, then the chunk size, that reduce a layout fastest on
this job's transport, with the export lines that make them the defaults."""

from ..reducer import Reducer
from .timing import time_interleaved
from .verify import expected, fill, verify_cases

__all__ = ["run_tune", "render_tune"]

BUCKETS = [256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
CHUNKS = [1 << 20, 4 << 20, 16 << 20, 64 << 20]
DEFAULTS = "defaults"


def _round(comm, grads, args, points, fixed):
    """Time an in-place reduce (the Reducer's defaults otherwise) for every
    value of one setting beside the defaults; returns ({value: Timing}, the
    names of wrong points)."""
    name, values = points
    reducers = {DEFAULTS: Reducer()}
    reducers.update((v, Reducer(**{name: v}, **fixed)) for v in values)
    sources = [g.copy() for g in grads]

    def rewrite():                  # backward writes the gradients before a reduce
        for g, s in zip(grads, sources):
            g[...] = s

    cases = {key: (lambda r=r: r.reduce(grads, inplace=True)) for key, r in reducers.items()}
    timings = time_interleaved(comm, cases, args.repeats, warmup=1,
                               prepare={key: rewrite for key in cases})
    want = expected([g.shape for g in grads], grads[0].dtype, comm.size, mean=True)
    failed = verify_cases(comm, cases, lambda: fill(grads, comm.rank), want)
    rewrite()
    for r in reducers.values():
        r.free()
    return timings, [f"{name} {key}" for key in failed]


def run_tune(comm, grads, args):
    """Sweep bucket_bytes at the default chunk, then chunk_bytes at the best
    bucket cap. Returns a dict for render_tune."""
    buckets, failed = _round(comm, grads, args, ("bucket_bytes", BUCKETS), {})
    best_bucket = min(BUCKETS, key=lambda v: buckets[v].min)
    chunks, wrong = _round(comm, grads, args, ("chunk_bytes", CHUNKS),
                           {"bucket_bytes": best_bucket})
    best_chunk = min(CHUNKS, key=lambda v: chunks[v].min)
    with Reducer() as defaults:
        default_bucket, default_chunk = defaults.bucket_bytes, defaults.chunk_bytes
    return {"buckets": buckets, "chunks": chunks, "best": (best_bucket, best_chunk),
            "defaults": (default_bucket, default_chunk), "failed": failed + wrong}


def _ms(timing):
    return f"{timing.min * 1e3:9.3f}  {timing.median * 1e3:9.3f}"


def render_tune(result, header):
    """The two sweeps, the winner's gain over the defaults (measured in the
    same round) and the export lines."""
    lines = [header, "in-place reduce (mean), ms per call: min, median over interleaved repeats"]
    for label, timings in (("bucket_bytes", result["buckets"]),
                           ("chunk_bytes (at the best bucket_bytes)", result["chunks"])):
        lines.append(f"{label}:")
        lines += [f"  {str(key):>10}  {_ms(t)}" for key, t in timings.items()]
    bucket, chunk = result["best"]
    best, defaults = result["chunks"][chunk], result["chunks"][DEFAULTS]
    gain = defaults.min / best.min
    given_bucket, given_chunk = result["defaults"]
    lines.append(f"best: bucket_bytes={bucket} chunk_bytes={chunk}: {gain:.3f}x the speed "
                 f"of the defaults (bucket_bytes={given_bucket or '1 MiB cap'}, "
                 f"chunk_bytes={given_chunk}), {best.min * 1e3:.3f} ms against "
                 f"{defaults.min * 1e3:.3f} ms")
    if gain < 1.02:
        lines.append("# the defaults are within 2% of the best, or faster, in the same round: "
                     "keep them, no export needed")
    else:
        lines += [f"export MPIGRAD_BUCKET_BYTES={bucket}", f"export MPIGRAD_CHUNK_BYTES={chunk}"]
    return "\n".join(lines)
