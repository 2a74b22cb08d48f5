"""Choosing the MPI library's transport before MPI starts: shared memory (the
default) or its TCP network path on the loopback interface, which behaves like
an Ethernet cluster on one machine (a few times the latency)."""

import os

__all__ = ["TRANSPORTS", "start_mpi"]

TRANSPORTS = ("shm", "tcp")

#: the switches of each library's TCP path, always on loopback (without
#: FI_TCP_IFACE=lo MPICH's TCP traffic goes to the machine's external address)
_TCP = {
    "MPICH": {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi",
              "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "lo"},
    "Open MPI": {"OMPI_MCA_btl": "tcp,self", "OMPI_MCA_pml": "ob1",
                 "OMPI_MCA_btl_tcp_if_include": "lo"},
}


def _library(version):
    for name in _TCP:
        if name in version:
            return name
    return None


def start_mpi(transport):
    """Initialise MPI over ``transport``; return its description for the
    report. Exits with a message for a transport the library is unknown for.

    Must run before anything imports mpi4py.MPI with initialisation on (it
    reads MPI4PY_RC_THREAD_LEVEL as mpi4py does).
    """
    import mpi4py
    mpi4py.rc.initialize = False           # set the switches first
    mpi4py.rc.finalize = True
    from mpi4py import MPI
    if MPI.Is_initialized():
        raise SystemExit("mpigrad-bench: MPI was initialised before the transport could be "
                         "chosen; run `python -m mpigrad.bench` or `mpigrad-bench` directly")
    version = MPI.Get_library_version().splitlines()[0].strip()
    library = _library(version)
    if transport == "tcp":
        if library is None:
            raise SystemExit(f"mpigrad-bench: --transport tcp: unknown MPI library "
                             f"({version}); set its TCP switches in the environment and run "
                             "with --transport shm")
        os.environ.update(_TCP[library])
    levels = {"single": MPI.THREAD_SINGLE, "funneled": MPI.THREAD_FUNNELED,
              "serialized": MPI.THREAD_SERIALIZED, "multiple": MPI.THREAD_MULTIPLE}
    MPI.Init_thread(levels[mpi4py.rc.thread_level])
    if transport == "tcp":
        switches = " ".join(f"{k}={v}" for k, v in _TCP[library].items())
        return f"tcp on loopback ({switches})"
    return "shm (the library's default)"
