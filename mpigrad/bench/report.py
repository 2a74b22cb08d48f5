"""Render a benchmark result as a table, CSV or JSON (rank 0 only)."""

import csv
import io
import json

from .casts import casts_line
from .peers import SMALL_CALLS
from .timing import Timing, looks_loaded, ratio_range, within_noise

__all__ = ["render", "rows", "ratios", "render_sweep", "plot_sweep", "check_plotting"]

_BASELINES = ("per-tensor Allreduce", "mpi floor")


def rows(result):
    """One dict per timed case: times in ms, bandwidths in GB/s, ratios."""
    timings, nbytes, p = result["timings"], result["wire_bytes"], result["ranks"]
    out = []
    for name, t in timings.items():
        algbw = nbytes / t.min / 1e9
        row = {"case": name, "min_ms": t.min * 1e3, "median_ms": t.median * 1e3,
               "algbw_GBps": algbw, "busbw_GBps": algbw * 2 * (p - 1) / p}
        for base in _BASELINES:
            if base in timings:
                row[f"x_{base.replace(' ', '_')}"] = t.min / timings[base].min
        out.append(row)
    return out


def library_label(version):
    """An MPI library's version line as a name and number: "MPICH 5.0.2",
    "Open MPI v5.0.11" (without the padding and the package details)."""
    first = version.splitlines()[0] if version else "unknown MPI"
    return " ".join(first.split(",")[0].replace("Version:", "").split())


def _header(result):
    cluster = (f"{result['nodes']} nodes x {result['ranks'] // result['nodes']} ranks (a cluster "
               f"of namespaces, link {result.get('link') or 'unlimited'}), "
               if result.get("nodes", 1) > 1 else "")
    return (f"layout {result['layout']} ({result['tensors']} tensors, {result['elements']:,} "
            f"{result['dtype']} elements, {result['wire_bytes'] / 2**20:.1f} MiB on the wire)\n"
            f"{cluster}{result['ranks']} ranks on {library_label(result['mpi'])}, transport "
            f"{result.get('transport', 'shm')}, the {'mean' if result['mean'] else 'sum'} of "
            f"the ranks' gradients, MPI threads: {result['thread_level']}"
            + (f"; MPI floor at {result['floor_chunk_bytes'] >> 10} KiB chunks"
               if result["floor_chunk_bytes"] else ""))


def render(result, fmt="table", targets=False, details=False):
    """The result for a user: what mpigrad's calls cost here against what one
    would use otherwise and which to pick; with ``details`` the floors, the
    table of every case and the notes; with ``targets`` the ratios this
    project's speed targets are stated in (``met`` / ``MISSED``). JSON and CSV
    always carry every case, ratio and target."""
    table, found = rows(result), ratios(result)
    if fmt == "json":
        doc = {k: v for k, v in result.items() if k != "timings"}
        doc["chunk_sweep"] = {str(k): v for k, v in result["chunk_sweep"].items()}
        doc["cases"] = table
        doc["ratios"] = found
        return json.dumps(doc, indent=2)
    if fmt == "csv":
        records = ([{"kind": "case", **row} for row in table]
                   + [{"kind": "ratio", **r} for r in found])
        buf = io.StringIO()
        writer = csv.DictWriter(buf, list(dict.fromkeys(k for r in records for k in r)))
        writer.writeheader()
        writer.writerows(records)
        return buf.getvalue().rstrip()
    # a loaded machine first: every ratio below is read in its light
    lines = [_header(result), *(f"warning: {n}" for n in _load_notes(result)), ""]
    lines += _summary(result, details)
    if details:
        lines += ["", "every case (min and median of the repeats; x_: time over that "
                  "baseline's):"]
        lines += _aligned(table)
    if targets:
        lines += ["", "ratios and this project's speed targets:"]
        lines += [_ratio_line(r) for r in found]
    if details:
        lines += [""] + [f"note: {n}" for n in result["notes"]]
        if result.get("casts"):
            lines.append("note: " + casts_line(result["casts"]))
        if result.get("device_route"):
            lines.append(f"note: {result['device_route']}")
    lines.append("result verified on every rank: " + ("yes" if result["verified"] else "NO"))
    if not details:
        lines.append(f"(--details: the floors, every one of the {len(table)} cases and the "
                     f"{len(result['notes'])} notes)")
    return "\n".join(lines)


def _load_notes(result):
    """A note when the run looks loaded: its ratios can swing between runs."""
    spread = looks_loaded(result["timings"].values())
    if spread is None:
        return []
    return [f"the machine looks loaded or noisy: the cases' median times are {spread:.2f}x "
            "their min (the median over cases); ratios can swing between runs: rerun with "
            "more --repeats on a quiet machine, and read the ranges"]


def _aligned(table):
    """Every case as a row of aligned columns."""
    keys = list(dict.fromkeys(k for row in table for k in row))
    return _columns(keys, [[row[k] if isinstance(row.get(k), str)
                            else (f"{row[k]:.3f}" if k in row else "-") for k in keys]
                           for row in table])


def _min_times(result):
    """{case: its min time in seconds}."""
    return {name: timing.min for name, timing in result["timings"].items()}


def _overlap_seconds(t):
    """(hidden, exposed): how much of the reduction overlap hid behind the
    simulated backward, out of how much a reduce after it added; None
    without the overlap cases."""
    if not all(k in t for k in ("backward only", "backward then reduce", "backward overlapped")):
        return None
    return (t["backward then reduce"] - t["backward overlapped"],
            t["backward then reduce"] - t["backward only"])


def _ddp_exposed(t, case="torch DDP backward"):
    """DDP's exposed communication (its backward minus a plain one), in
    seconds; None without the DDP cases (``case``: on gloo, or on mpigrad's
    backend)."""
    if case in t and "torch backward (no DDP)" in t:
        return t[case] - t["torch backward (no DDP)"]
    return None


#: the summary's calls and what each is compared with: (case, label)
_CALLS = (("mpigrad reduce inplace", "reduce(grads, inplace=True)"),
          ("mpigrad reduce", "reduce(grads): new arrays"),
          ("mpigrad zero-copy", "zero-copy: bucket_views"))
#: each call's pattern in a trainer, as the README shows it (tests/test_bench.py holds them
#: to the README's first snippet)
PATTERNS = {
    "mpigrad zero-copy": ("grads = reducer.bucket_views(grads)",
                          "reducer.reduce(grads, inplace=True)"),
    "mpigrad reduce inplace": ("reducer.reduce(grads, inplace=True)",),
    "mpigrad reduce": ("grads = reducer.reduce(grads)",),
}
_OTHERS = (("per-tensor Allreduce", "per-tensor loop"),
           ("mpi floor", "MPI, one buffer"),
           ("gloo all_reduce (flat)", "gloo, one buffer"),
           ("horovod grouped_allreduce", "Horovod grouped"))

#: each floor: (case, the traffic it needs per rank, the sums it bounds)
_FLOORS = (("copy floor", "reads N, writes N (a copy)", "a sum into each rank's own memory"),
           ("shared-bucket floor", "reads N, writes N/p", "a sum in node-shared buckets"),
           ("mpi floor", "MPI's allreduce of N packed", "a sum through MPI"),
           ("link floor", "2(n-1)/n N each way across the link, raw TCP",
            "a sum across n nodes"))


def _floor_of(result, case):
    """The floor case that bounds ``case`` from below, by the backend that
    summed it: node-shared buckets (zero-copy), MPI, or a node sum into each
    rank's memory (a copy)."""
    backend = result.get("backends", {}).get(case)
    if result.get("nodes", 1) > 1:
        return "link floor"
    if backend == "mpi":
        return "mpi floor"
    if backend == "node memory" and case == "mpigrad zero-copy":
        return "shared-bucket floor"
    return "copy floor"


def _speedup(timings, other, case):
    """The other's time over mpigrad's (min over min), its range over the
    repeats, and "~" where the two are within noise."""
    low, high = ratio_range(timings[other], timings[case])
    mark = " ~" if within_noise(timings[other], timings[case]) else ""
    return f"{timings[other].min / timings[case].min:.2f}x ({low:.2f}-{high:.2f}){mark}"


def _summary(result, details=False):
    """What a user asks first: each of mpigrad's calls against what one would
    use otherwise (a per-tensor loop; MPI's, gloo's or Horovod's allreduce of
    the same bytes) as speed-ups with their range over the repeats, and
    against the floor that bounds it (``details``)."""
    timings, t = result["timings"], _min_times(result)
    calls = [(case, label) for case, label in _CALLS if case in t]
    others = [(case, label) for case, label in _OTHERS if case in t]
    if not calls:                     # the sparse suite: its table says it all
        return []
    header = ["mpigrad call", "ms"] + [f"vs {label}" for _, label in others]
    cells = [[label, f"{t[case] * 1e3:.2f}"] + [_speedup(timings, other, case)
                                                for other, _ in others]
             for case, label in calls]
    lines = [f"mpigrad on {result['ranks']} ranks, min of the repeats; speed-up = the other's "
             "time / mpigrad's (above 1: mpigrad is faster), in brackets its range over the "
             "repeats; ~: within noise (the two cases' min-to-median times overlap):"]
    lines += ["  " + line for line in _columns(header, cells)]
    lines.append("  (per-tensor loop: an Allreduce per gradient; one buffer: an allreduce of "
                 "the same bytes already packed, the floor of that library)")
    if details:
        lines += _floors(result, calls)
    lines += _pick(t, calls)
    for backend, case in (("gloo", "torch DDP backward"),
                          ("gloo with bf16_compress_hook",
                           "torch DDP backward, bf16_compress_hook"),
                          ("the mpigrad backend", "torch DDP backward, mpigrad backend")):
        exposed = _ddp_exposed(t, case)
        if exposed is not None:
            lines.append(f"  torch DDP's exposed communication on {backend} (its backward minus "
                         "a plain one): " + (f"{exposed * 1e3:.2f} ms" if exposed > 0 else
                                             "none measurable in this run (within noise)"))
    lines += _torch_distributed(t)
    lines += _overlap(result, t)
    return lines


def _pick(t, calls):
    """Which call to pick: the fastest here, against the per-tensor loop one
    would write otherwise."""
    if len(calls) < 2:
        return []
    fastest, label = min(calls, key=lambda call: t[call[0]])
    line = f"  the call to pick here: {label} ({t[fastest] * 1e3:.2f} ms"
    if "per-tensor Allreduce" in t:
        line += f", {_speed(t['per-tensor Allreduce'], t[fastest])} than the per-tensor loop"
    line += ")"
    lines = [line, "    " + "; then each step: ".join(PATTERNS[fastest])
             + ("   (the README's first snippet)" if fastest == "mpigrad zero-copy" else "")]
    if fastest == "mpigrad zero-copy":
        lines.append("    with torch, mpigrad.torch.DistributedOptimizer reduces zero-copy for you")
    return lines


def _torch_distributed(t):
    """torch.distributed's all_reduce on gloo against the mpigrad backend."""
    pairs = [("one buffer", "gloo all_reduce (flat)", "mpigrad backend all_reduce (flat)", 1),
             ("1 KiB, per call", f"gloo all_reduce 1 KiB x {SMALL_CALLS}",
              f"mpigrad backend all_reduce 1 KiB x {SMALL_CALLS}", SMALL_CALLS)]
    return [f"  torch.distributed all_reduce, {what}: gloo {t[gloo] / calls * 1e3:.3f} ms, the "
            f"mpigrad backend {t[mine] / calls * 1e3:.3f} ms ({_speed(t[gloo], t[mine])})"
            for what, gloo, mine, calls in pairs if gloo in t and mine in t]


def _speed(other, mine):
    """mpigrad's time against another's in words: "3.20x faster", "1.09x slower"
    (a ratio below 1 is never called faster)."""
    return f"{other / mine:.2f}x faster" if mine <= other else f"{mine / other:.2f}x slower"


def _floors(result, calls):
    """The floors timed, each with the traffic it needs per rank and the
    calls it bounds, each call's time as a multiple of its floor's."""
    t, timings = _min_times(result), result["timings"]
    cells = []
    for floor, traffic, bounds in _FLOORS:
        if floor in t:
            # no call beats its floor (docs/benchmark.md): one that reads below it is within
            # the run's noise, and says so
            mine = [f"{label} {t[case] / t[floor]:.2f}x"
                    + (" (within noise of the floor)" if t[case] < t[floor] * 1.02
                       or within_noise(timings[case], timings[floor]) else "")
                    for case, label in calls if _floor_of(result, case) == floor]
            cells.append([floor, f"{t[floor] * 1e3:.2f}", traffic,
                          bounds + (f": {', '.join(mine)}" if mine else "")])
    lines = [f"  floors per rank (N: the {result['wire_bytes'] / 2**20:.1f} MiB on the wire, "
             f"p: {result.get('node_ranks') or result['ranks']} ranks on a node), and each "
             "call's time over the floor of its path:"]
    aligned = _columns(["floor", "ms"], [row[:2] for row in cells])
    width = max(len(row[2]) for row in cells) if cells else 0
    return lines + [f"    {aligned[0]}  {'traffic per rank'.ljust(width)}  the least for"] + [
        f"    {line}  {row[2].ljust(width)}  {row[3]}" for line, row in zip(aligned[1:], cells)]


def _columns(header, cells):
    """Rows of cells as columns as wide as their widest cell (the first to
    the left, the others to the right)."""
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(header)]

    def line(values):
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w)
                         for i, (v, w) in enumerate(zip(values, widths))).rstrip()
    return [line(header)] + [line(row) for row in cells]


def _overlap(result, t):
    """The share of the reduction hidden behind a simulated backward; where
    none is, why (a negative share is no overlap, not a result)."""
    overlap = _overlap_seconds(t)
    if overlap is None:
        return []
    hidden, exposed = overlap
    if exposed > 0 and hidden > 0.05 * exposed:
        return [f"  overlap with backward (start/ready/wait) hides {hidden / exposed:.0%} of the "
                f"communication ({hidden * 1e3:.1f} of {exposed * 1e3:.1f} ms; "
                f"{(exposed - hidden) * 1e3:.1f} ms exposed per step)"]
    cores, local = result.get("cores"), result.get("node_ranks")
    why = (f": {local} ranks share {cores} cores here, so the simulated backward and the "
           "reduction compete for them" if cores and local and cores < 2 * local else
           ": the reduction is too short, or too noisy here, to be seen behind backward")
    return [f"  overlap with backward: none measurable in this run{why}"]


def _spread(timings, num, den):
    """A ratio's range over the repeats (the denominators summed repeat by
    repeat) and whether its two sides are within noise."""
    total = Timing(" + ".join(den))
    total.times = [sum(times) for times in zip(*(timings[d].times for d in den))]
    low, high = ratio_range(timings[num], total)
    return {"low": low, "high": high, "within_noise": within_noise(timings[num], total)}


def _ratio_line(record):
    line = f"{record['ratio']}: {record['value']:.3f}"
    if "low" in record:
        line += (f" ({record['low']:.3f}-{record['high']:.3f} over the repeats"
                 + ("; within noise)" if record["within_noise"] else ")"))
    if "note" in record:
        line += f" ({record['note']})"
    if record["target"] is not None:
        line += (f" (target {'>=' if record['above'] else '<='} {record['target']:g}: "
                 f"{'met' if record['met'] else 'MISSED'})")
    return line


def ratios(result):
    """The ratios the project's speed targets are stated in, each with its
    target for this layout and transport where one is set: a list of
    {ratio, value, target, above, met} (``above``: the target is a lower
    bound; ``met``: None without a target)."""
    t = _min_times(result)
    small, tcp = result["layout"] == "small", result.get("transport_kind") == "tcp"
    found = []

    def record(label, value, target=None, above=False, spread=None, note=None):
        met = None if target is None else bool(value >= target if above else value <= target)
        found.append({"ratio": label, "value": value, "target": target, "above": above,
                      "met": met, **(spread or {}), **({"note": note} if note else {})})

    def ratio(label, num, den, target=None, above=False):
        """``num`` over the sum of ``den``; a target is a bound the ratio
        stays under (``above``: over)."""
        den = den if isinstance(den, tuple) else (den,)
        if num in t and all(d in t for d in den):
            record(label, t[num] / sum(t[d] for d in den), target, above,
                   _spread(result["timings"], num, den))

    mean = "mean" if result["mean"] else "sum"
    cluster = result.get("nodes", 1) > 1

    def one_node(target):
        """A target stated for one node (memory-bound, or against gloo on loopback):
        none across nodes, where the link sets the pace."""
        return None if cluster else target

    ratio(f"inplace ({mean}) / link floor", "mpigrad reduce inplace", "link floor", 1.10)
    ratio(f"zero-copy ({mean}) / link floor", "mpigrad zero-copy", "link floor", 1.05)
    ratio("mpi floor / link floor", "mpi floor", "link floor")
    ratio(f"inplace, bf16 wire / inplace ({mean})", "mpigrad inplace, bf16 wire",
          "mpigrad reduce inplace", 0.55 if cluster else None)
    ratio(f"inplace, reproducible / inplace ({mean})", "mpigrad inplace, reproducible",
          "mpigrad reduce inplace", one_node(2.0))
    ratio("DDP with bf16_compress_hook (backward) / inplace, bf16 wire",
          "torch DDP backward, bf16_compress_hook", "mpigrad inplace, bf16 wire",
          1.5 if cluster else None, above=True)
    # in place never behind MPI's own Allreduce of the packed buffer (issue 52)
    ratio(f"mpi floor / inplace ({mean})", "mpi floor", "mpigrad reduce inplace",
          None if small else 1.0, above=True)
    ratio(f"zero-copy ({mean}) / mpi floor", "mpigrad zero-copy", "mpi floor",
          (1.5 if tcp else None) if small else 1.05)
    ratio(f"reduce ({mean}) / (mpi floor + copy floor)", "mpigrad reduce",
          ("mpi floor", "copy floor"), None if small else 1.15)
    if "mpigrad zero-copy, MPI" in t:          # the defaults sum in node memory
        ratio("zero-copy in node memory / copy floor", "mpigrad zero-copy", "copy floor",
              None if small else one_node(1.2))
        ratio("zero-copy in node memory / shared-bucket floor", "mpigrad zero-copy",
              "shared-bucket floor")
        ratio("mpi floor / zero-copy in node memory", "mpi floor", "mpigrad zero-copy",
              None if small else one_node(1.25 if "Open MPI" in result["mpi"] else 1.5),
              above=True)
    ratio("zero-copy through MPI / in node memory", "mpigrad zero-copy, MPI",
          "mpigrad zero-copy")
    if "mpigrad reduce, no cross-memory" in t:  # the defaults sum through cross-memory
        ratio(f"inplace ({mean}) / copy floor", "mpigrad reduce inplace", "copy floor",
              None if small else one_node(1.3))
        ratio(f"reduce ({mean}) / copy floor", "mpigrad reduce", "copy floor",
              None if small else one_node(1.5))
        ratio("inplace without cross-memory / with", "mpigrad inplace, no cross-memory",
              "mpigrad reduce inplace")
        ratio("reduce without cross-memory / with", "mpigrad reduce, no cross-memory",
              "mpigrad reduce")
    ratio("reduce through MPI / in node memory", "mpigrad reduce, MPI",
          "mpigrad reduce", None if small else one_node(1.25), above=True)
    ratio("per-tensor loop / reduce", "per-tensor Allreduce", "mpigrad reduce",
          (15 if tcp else 3) if small else 1.3, above=True)
    ratio("per-tensor loop / zero-copy", "per-tensor Allreduce", "mpigrad zero-copy")
    # half precision summed where it lies, at half the bytes, in one fused pass (issue 67)
    ratio(f"{result['dtype']} reduce / float32 reduce", "mpigrad reduce",
          "mpigrad reduce, float32 gradients",
          one_node(0.6) if result["dtype"] in ("float16", "bfloat16") else None)
    ratio("inplace mean / inplace sum", "mpigrad reduce inplace", "mpigrad inplace, sum")
    ratio("inplace mean / inplace sum", "mpigrad inplace, mean", "mpigrad reduce inplace")
    overlap = _overlap_seconds(t)
    if overlap is not None and overlap[1] > 0:
        share = overlap[0] / overlap[1]
        record("overlap: share of the communication hidden behind backward", max(0.0, share),
               note=f"{share:.3f} measured: none, within noise" if share < 0 else None)
        # across nodes, behind a backward of 300 ms or more (issue 35's regime)
        record("overlap: share of the communication exposed", min(1.0, 1 - share),
               0.30 if cluster and result.get("backward_ms", 0) >= 300 else None)
    ratio("gloo flat all_reduce / mpigrad inplace", "gloo all_reduce (flat)",
          "mpigrad reduce inplace")
    ratio("horovod grouped_allreduce / mpigrad inplace", "horovod grouped_allreduce",
          "mpigrad reduce inplace")
    ratio("mpigrad.horovod grouped_allreduce / mpigrad inplace",
          "mpigrad.horovod grouped_allreduce", "mpigrad reduce inplace", one_node(1.15))
    exposed = _ddp_exposed(t)
    if exposed is not None and "mpigrad reduce inplace" in t:
        record("DDP exposed communication / mpigrad inplace",
               max(0.0, exposed) / t["mpigrad reduce inplace"],
               note="none measurable: within noise" if exposed <= 0 else None)
    ratio("inplace through MPI / the same with check off (node sums need the check)",
          "mpigrad inplace, MPI", "mpigrad inplace, check off")
    ratio("gloo flat all_reduce / mpigrad backend's", "gloo all_reduce (flat)",
          "mpigrad backend all_reduce (flat)", None if small else one_node(4.0), above=True)
    ratio("mpigrad backend flat all_reduce / mpigrad inplace", "mpigrad backend all_reduce (flat)",
          "mpigrad reduce inplace", None if small else 1.1)
    mine = _ddp_exposed(t, "torch DDP backward, mpigrad backend")
    if mine is not None and exposed is not None and exposed > 0:
        record("DDP exposed communication: mpigrad backend / gloo", max(0.0, mine) / exposed,
               one_node(0.4))
    ratio("1 KiB all_reduce: mpigrad backend / gloo",
          f"mpigrad backend all_reduce 1 KiB x {SMALL_CALLS}",
          f"gloo all_reduce 1 KiB x {SMALL_CALLS}", one_node(0.1))
    ratio("1 KiB all_reduce: mpigrad backend / MPI's Allreduce",
          f"mpigrad backend all_reduce 1 KiB x {SMALL_CALLS}",
          f"MPI Allreduce 1 KiB x {SMALL_CALLS}", one_node(8.0))
    ratio("1 KiB allreduce: mpigrad.allreduce / MPI's Allreduce",
          f"mpigrad.allreduce 1 KiB x {SMALL_CALLS}", f"MPI Allreduce 1 KiB x {SMALL_CALLS}",
          one_node(4.0))
    ratio("1000 x 256: per-tensor loop / reduce", "per-tensor Allreduce 1000 x 256",
          "mpigrad reduce 1000 x 256", one_node(4.0), above=True)
    ratio("reduce_scatter_tensor / all_reduce of the same buffer, mpigrad backend",
          "mpigrad backend reduce_scatter_tensor (flat)", "mpigrad backend all_reduce (flat)",
          None if small else one_node(0.6))
    ratio("reduce_scatter_tensor: gloo / mpigrad backend",
          "gloo reduce_scatter_tensor (flat)", "mpigrad backend reduce_scatter_tensor (flat)")
    for stack in ("stack", "layout"):
        ratio(f"FSDP2 step ({stack}): gloo / mpigrad backend", f"gloo FSDP2 step ({stack})",
              f"mpigrad backend FSDP2 step ({stack})", one_node(2.5), above=True)
    ratio("inplace / inplace with watchdog off", "mpigrad reduce inplace",
          "mpigrad inplace, watchdog off")
    ratio("inplace, on_failure=shrink (private memory) / inplace through MPI",
          "mpigrad inplace, on_failure=shrink", "mpigrad inplace, MPI")
    ratio("DistributedOptimizer step / zero-copy reduce + SGD step, same backward",
          "torch DistributedOptimizer step", "torch zero-copy reduce + SGD step",
          None if small else 1.10)
    ratio("inplace with check_finite / inplace", "mpigrad inplace, check_finite",
          "mpigrad reduce inplace", 1.05)
    ratio("reduce_scatter + allgather_shards / mpi floor (the same bytes)",
          "mpigrad reduce_scatter + allgather_shards", "mpi floor")
    ratio("reduce_scatter + allgather_shards / inplace",
          "mpigrad reduce_scatter + allgather_shards", "mpigrad reduce inplace")
    ratio("ShardedOptimizer Adam step / DistributedOptimizer Adam step, same backward",
          "torch ShardedOptimizer Adam step", "torch DistributedOptimizer Adam step", 1.10)
    return found


def render_sweep(args, label, sweep_rows, fmt="table"):
    """A sweep's rows (x, case, min s, median s) as a table, CSV or JSON."""
    records = [{label: x, "case": case, "min_ms": lo * 1e3, "median_ms": med * 1e3}
               for x, case, lo, med in sweep_rows]
    if fmt == "json":
        return json.dumps({"sweep": args.sweep, "layout": args.layout, "rows": records},
                          indent=2)
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.DictWriter(buf, list(records[0]))
        writer.writeheader()
        writer.writerows(records)
        return buf.getvalue().rstrip()
    lines = [f"sweep {args.sweep} (layout {args.layout} where it applies)",
             f"{label:>24}  {'case':<24}  {'min_ms':>10}  {'median_ms':>10}"]
    lines += [f"{r[label]:>24}  {r['case']:<24}  {r['min_ms']:>10.3f}  {r['median_ms']:>10.3f}"
              for r in records]
    return "\n".join(lines)


def check_plotting():
    """None if ``--plot`` can draw (matplotlib importable), else what to do."""
    import importlib.util
    if importlib.util.find_spec("matplotlib") is None:
        return ("--plot needs matplotlib, which is not installed: pip install matplotlib "
                "(or, in a clone of mpigrad, pip install -e '.[plot]')")
    return None


def plot_sweep(args, label, sweep_rows, path):
    """Plot min time against the swept size, one line per case (matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for case in dict.fromkeys(r[1] for r in sweep_rows):
        points = [(x, lo * 1e3) for x, c, lo, _ in sweep_rows if c == case]
        ax.plot(*zip(*points), marker="o", label=case)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(label)
    ax.set_ylabel("time per call, min (ms)")
    ax.set_title(f"mpigrad-bench --sweep {args.sweep}")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
