"""Render a benchmark result as a table, CSV or JSON (rank 0 only)."""

import csv
import io
import json

__all__ = ["render", "rows", "render_sweep", "plot_sweep"]

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


def _header(result):
    return (f"layout {result['layout']} ({result['tensors']} tensors, {result['elements']:,} "
            f"{result['dtype']} elements, {result['wire_bytes'] / 2**20:.1f} MiB on the wire), "
            f"{result['ranks']} ranks, thread level {result['thread_level']}, "
            f"{'mean' if result['mean'] else 'sum'}, {result['mpi']}, "
            f"transport {result.get('transport', 'shm')}"
            + (f"; mpi floor chunk {result['floor_chunk_bytes'] >> 10} KiB"
               if result["floor_chunk_bytes"] else ""))


def render(result, fmt="table"):
    table = rows(result)
    if fmt == "json":
        doc = {k: v for k, v in result.items() if k != "timings"}
        doc["chunk_sweep"] = {str(k): v for k, v in result["chunk_sweep"].items()}
        doc["cases"] = table
        return json.dumps(doc, indent=2)
    keys = list(dict.fromkeys(k for row in table for k in row))
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.DictWriter(buf, keys)
        writer.writeheader()
        writer.writerows(table)
        return buf.getvalue().rstrip()
    lines = [_header(result)]
    widths = [max(len(k), 24 if k == "case" else 8) for k in keys]
    lines.append("  ".join(k.ljust(w) for k, w in zip(keys, widths)))
    for row in table:
        cells = [row[k] if isinstance(row.get(k), str) else
                 (f"{row[k]:.3f}" if k in row else "-") for k in keys]
        lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths)))
    lines += _targets(result)
    lines += [f"note: {n}" for n in result["notes"]]
    lines.append("result verified on every rank: "
                 + ("yes" if result["verified"] else "NO"))
    return "\n".join(lines)


def _targets(result):
    """The ratios the project's speed targets are stated in, each with its
    target for this layout and transport where one is set."""
    t = {name: timing.min for name, timing in result["timings"].items()}
    small, tcp = result["layout"] == "small", result.get("transport_kind") == "tcp"
    lines = []

    def ratio(label, num, den, target=None, above=False):
        """``num`` over the sum of ``den``; a target is a bound the ratio
        stays under (``above``: over)."""
        den = den if isinstance(den, tuple) else (den,)
        if num not in t or not all(d in t for d in den):
            return
        value = t[num] / sum(t[d] for d in den)
        line = f"{label}: {value:.3f}"
        if target is not None:
            met = value >= target if above else value <= target
            line += f" (target {'>=' if above else '<='} {target:g}: {'met' if met else 'MISSED'})"
        lines.append(line)

    mean = "mean" if result["mean"] else "sum"
    ratio(f"inplace ({mean}) / mpi floor", "mpigrad reduce inplace", "mpi floor",
          None if small else 1.10)
    ratio(f"zero-copy ({mean}) / mpi floor", "mpigrad zero-copy", "mpi floor",
          (1.5 if tcp else None) if small else 1.05)
    ratio(f"reduce ({mean}) / (mpi floor + memory floor)", "mpigrad reduce",
          ("mpi floor", "memory floor"), None if small else 1.15)
    if "mpigrad zero-copy, MPI" in t:          # the defaults sum in node memory
        ratio("zero-copy in node memory / memory floor", "mpigrad zero-copy", "memory floor",
              None if small else 1.2)
        ratio("mpi floor / zero-copy in node memory", "mpi floor", "mpigrad zero-copy",
              None if small else (1.25 if "Open MPI" in result["mpi"] else 1.5), above=True)
    ratio("zero-copy through MPI / in node memory", "mpigrad zero-copy, MPI",
          "mpigrad zero-copy")
    if "mpigrad reduce, no cross-memory" in t:  # the defaults sum through cross-memory
        ratio(f"inplace ({mean}) / memory floor", "mpigrad reduce inplace", "memory floor",
              None if small else 1.3)
        ratio(f"reduce ({mean}) / memory floor", "mpigrad reduce", "memory floor",
              None if small else 1.5)
        ratio("inplace without cross-memory / with", "mpigrad inplace, no cross-memory",
              "mpigrad reduce inplace")
        ratio("reduce without cross-memory / with", "mpigrad reduce, no cross-memory",
              "mpigrad reduce")
    ratio("reduce through MPI / in node memory", "mpigrad reduce, MPI",
          "mpigrad reduce", None if small else 1.25, above=True)
    ratio("per-tensor loop / reduce", "per-tensor Allreduce", "mpigrad reduce",
          (15 if tcp else 3) if small else 1.0, above=True)
    ratio("per-tensor loop / zero-copy", "per-tensor Allreduce", "mpigrad zero-copy")
    ratio(f"{result['dtype']} reduce / float32 reduce", "mpigrad reduce",
          "mpigrad reduce, float32 gradients", 1.2 if result["dtype"] == "float16" else None)
    ratio("inplace mean / inplace sum", "mpigrad reduce inplace", "mpigrad inplace, sum")
    ratio("inplace mean / inplace sum", "mpigrad inplace, mean", "mpigrad reduce inplace")
    if all(k in t for k in ("backward only", "backward then reduce", "backward overlapped")):
        exposed = t["backward then reduce"] - t["backward only"]
        hidden = t["backward then reduce"] - t["backward overlapped"]
        lines.append(f"overlap hides {hidden / exposed:.0%} of the communication "
                     f"({hidden * 1e3:.1f} of {exposed * 1e3:.1f} ms)")
    ratio("gloo flat all_reduce / mpigrad inplace", "gloo all_reduce (flat)",
          "mpigrad reduce inplace")
    ratio("horovod grouped_allreduce / mpigrad inplace", "horovod grouped_allreduce",
          "mpigrad reduce inplace")
    if "torch DDP backward" in t and "torch backward (no DDP)" in t:
        exposed = t["torch DDP backward"] - t["torch backward (no DDP)"]
        lines.append(f"DDP exposed communication {exposed * 1e3:.1f} ms; "
                     f"/ mpigrad inplace: {exposed / t['mpigrad reduce inplace']:.3f}")
    ratio("inplace / inplace with check off", "mpigrad reduce inplace",
          "mpigrad inplace, check off")
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
    return lines


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


def plot_sweep(args, label, sweep_rows, path):
    """Plot min time against the swept size, one line per case (matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'mpigrad[plot]'") from None
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
