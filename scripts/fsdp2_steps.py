"""FSDP2 training steps of the bench's communication-heavy stack (8
``fully_shard``ed Linear(2048, 2048) layers, a batch of 4) on gloo and on the
mpigrad backend, interleaved step by step, each step's time the max over the
ranks: the min and median of each and their ratio, over the whole run and its
second half (after the first calls' one-time costs). Run it once as it is
and once with MPIGRAD_HUGE_PAGES=0 to see what the huge-page policy costs or
buys FSDP2's buffers.

    mpiexec -n 2 python scripts/fsdp2_steps.py [steps, default 30]
"""

import socket
import statistics
import sys
import time

from mpi4py import MPI
import torch
import torch.distributed as dist

from mpigrad.bench.peers import fsdp2_stack, fsdp2_step


def main() -> None:
    comm = MPI.COMM_WORLD
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank,
                            world_size=comm.size)
    import mpigrad.torch  # noqa: F401  (registers the backend)
    torch.set_num_threads(1)
    mine = dist.new_group(backend="mpigrad")
    cases = {"gloo": fsdp2_step(fsdp2_stack(), None), "mpigrad": fsdp2_step(fsdp2_stack(), mine)}
    times = {name: [] for name in cases}
    for _ in range(steps):
        for name, step in cases.items():
            comm.Barrier()
            began = time.perf_counter()
            step()
            times[name].append(comm.allreduce(time.perf_counter() - began, op=MPI.MAX))
    if comm.rank == 0:
        for name, values in times.items():
            print(f"{name:8s} min {min(values) * 1e3:7.1f} ms, "
                  f"median {statistics.median(values) * 1e3:7.1f} ms")
        late = steps // 2
        print("gloo / mpigrad: min {:.2f}, median {:.2f}, median of the second half {:.2f}"
              .format(min(times["gloo"]) / min(times["mpigrad"]),
                      statistics.median(times["gloo"]) / statistics.median(times["mpigrad"]),
                      statistics.median(times["gloo"][late:])
                      / statistics.median(times["mpigrad"][late:])))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
