"""Nodes on one machine: each a network, UTS, IPC and mount namespace, joined by a
rate-limited link.

MPI sees separate hosts (each node has its own hostname, ``/dev/shm``, System V IPC,
``/sys`` and address on a private subnet), so its processes split into nodes as on a cluster and the
bytes between nodes cross a link of the chosen rate (tc's ``tbf`` on each node's side).
MPI's launcher reaches a node through an agent that stands in for ``ssh``: MPICH's
``-launcher ssh -launcher-exec AGENT``, Open MPI's ``--mca plm_ssh_agent AGENT``.

Needs root (``CAP_NET_ADMIN`` and ``CAP_SYS_ADMIN``), util-linux's ``unshare``/``nsenter``
and iproute2's ``ip``/``tc``; :func:`missing` names what is absent. Everything is torn
down on every exit of :func:`cluster`; if the controlling process is killed outright, each
node's holder sees its pipe close and ends, which frees the namespaces.

    python -m mpigrad.bench.cluster --nodes 2 --ppn 2 --link 2gbit -- python prog.py

runs ``mpiexec`` (of the MPI on ``PATH``) with 2 ranks on each of 2 nodes, from node 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

INTERFACE = "link0"          # every node's side of the link has this name
SUBNET = "10.77.{}.{}"       # node i is 10.77.<cluster>.<i + 1>
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$", re.IGNORECASE)
_SCALE = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def link_bits_per_second(rate: str) -> float:
    """A tc rate such as ``2gbit`` or ``500mbit`` in bits per second."""
    match = _RATE.match(rate.strip())
    if match is None:
        raise ValueError(f"link rate: expected a number and one of bit, kbit, mbit, gbit, tbit "
                         f"(as tc writes it, e.g. 2gbit or 500mbit), got {rate!r}")
    return float(match[1]) * _SCALE[match[2].lower()]


def missing() -> str | None:
    """What this machine lacks to make a cluster, or None when it has everything."""
    if os.geteuid() != 0:
        return "root (for CAP_NET_ADMIN and CAP_SYS_ADMIN: namespaces, veth, tc)"
    absent = [tool for tool in ("unshare", "nsenter", "ip", "tc") if shutil.which(tool) is None]
    if absent:
        return f"{', '.join(absent)} (util-linux's unshare and nsenter, iproute2's ip and tc)"
    probe = subprocess.run(["unshare", "--net", "--uts", "--ipc", "--mount", "true"],
                           capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"unshare --net --uts --ipc --mount (it failed: {probe.stderr.strip()})"
    return None


@dataclass(frozen=True)
class Node:
    """One node: its hostname, its address and a process inside its namespaces."""

    name: str
    address: str
    pid: int

    def enter(self, argv: Sequence[str], workdir: str | None = None) -> list[str]:
        """``argv`` run inside this node, in ``workdir`` (the caller's by default)."""
        where = workdir or os.getcwd()
        return ["nsenter", "-t", str(self.pid), "--net", "--uts", "--ipc", "--mount",
                f"--wd={where}",
                "--", *argv]


@dataclass(frozen=True)
class Cluster:
    """Nodes joined by one link (a bridge for more than two), and the agent that enters them."""

    nodes: tuple[Node, ...]
    agent: Path
    link: str | None

    @property
    def hosts(self) -> list[str]:
        return [node.name for node in self.nodes]

    def mpiexec(self, ranks_per_node: int | Sequence[int], mpiexec: str = "mpiexec"
                ) -> list[str]:
        """The launch line onto these nodes, ``ranks_per_node`` on each (or node by node)."""
        return mpiexec_line(self.hosts, self.agent, ranks_per_node, mpiexec)

    def environment(self, ranks_per_node: int | Sequence[int]) -> dict[str, str]:
        """What MPI needs to keep to the link (its interface), where the nodes are (for
        ``from_environment``), and, where the ranks outnumber this machine's cores, Open MPI
        told to yield while it waits (else its spinning ranks starve the others: a test step
        took 298 s instead of 45)."""
        crowded = sum(_per_node(ranks_per_node, len(self.nodes))) > (os.cpu_count() or 1)
        return {"FI_PROVIDER": "tcp", "FI_TCP_IFACE": INTERFACE,
                "OMPI_MCA_mpi_yield_when_idle": "1" if crowded else "0",
                "OMPI_MCA_btl_tcp_if_include": INTERFACE,
                "PRTE_MCA_oob_tcp_if_include": INTERFACE, "GLOO_SOCKET_IFNAME": INTERFACE,
                "MPIGRAD_CLUSTER_HOSTS": ",".join(self.hosts),
                "MPIGRAD_CLUSTER_AGENT": str(self.agent),
                "MPIGRAD_CLUSTER_LINK": self.link or ""}


def _per_node(ranks_per_node: int | Sequence[int], nodes: int) -> list[int]:
    if isinstance(ranks_per_node, int):
        return [ranks_per_node] * nodes
    if len(ranks_per_node) != nodes:
        raise ValueError(f"ranks per node: expected one count per node ({nodes}), got "
                         f"{list(ranks_per_node)}")
    return list(ranks_per_node)


def mpiexec_line(hosts: Sequence[str], agent: Path | str, ranks_per_node: int | Sequence[int],
                 mpiexec: str = "mpiexec", ranks: int | None = None) -> list[str]:
    """The launch line of the MPI whose ``mpiexec`` this is onto ``hosts`` through ``agent``,
    ``ranks_per_node`` on each, or a count per host (consecutive ranks fill each host in
    turn); ``ranks``: fewer in all, the last node's slots left free."""
    counts = _per_node(ranks_per_node, len(hosts))
    ranks = sum(counts) if ranks is None else ranks
    if mpi_family(mpiexec) == "openmpi":
        slots = ",".join(f"{host}:{count}" for host, count in zip(hosts, counts))
        return [mpiexec, "--host", slots, "--mca", "plm_ssh_agent", str(agent),
                "--mca", "btl_tcp_if_include", INTERFACE, "--mca", "oob_tcp_if_include",
                INTERFACE, "-n", str(ranks)]
    placed = (["-hosts", ",".join(hosts), "-ppn", str(counts[0])] if len(set(counts)) == 1
              else ["-hosts", ",".join(f"{host}:{count}" for host, count in zip(hosts, counts))])
    return [mpiexec, *placed, "-launcher", "ssh", "-launcher-exec", str(agent), "-n", str(ranks)]


def from_environment(ranks_per_node: int, mpiexec: str = "mpiexec",
                     ranks: int | None = None) -> list[str] | None:
    """Inside a cluster's command (``--no-mpiexec``): the launch line onto its nodes (as
    ``mpiexec_line``), or None outside one."""
    hosts = os.environ.get("MPIGRAD_CLUSTER_HOSTS", "")
    agent = os.environ.get("MPIGRAD_CLUSTER_AGENT", "")
    if not hosts or not agent:
        return None
    return mpiexec_line(hosts.split(","), agent, ranks_per_node, mpiexec, ranks)


def mpi_family(mpiexec: str = "mpiexec") -> str:
    """``openmpi`` or ``mpich``, from what ``mpiexec --version`` prints."""
    found = shutil.which(mpiexec)
    if found is None:
        raise FileNotFoundError(f"expected an mpiexec on PATH, got none ({mpiexec!r}); "
                                "install mpigrad's mpich or openmpi extra")
    version = subprocess.run([found, "--version"], capture_output=True, text=True, check=False)
    return "openmpi" if "Open MPI" in version.stdout + version.stderr else "mpich"


_HOLDER = """
hostname {name}
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t sysfs sysfs /sys
mount --bind {hosts} /etc/hosts
ip link set lo up
echo ready
read _
"""

_AGENT = """#!/bin/sh
# ssh's stand-in for MPI's launcher: [options] HOST COMMAND... run in HOST's namespaces
while [ $# -gt 1 ]; do
  case $1 in
    -[bcDEeFIiJLlmOoPpQRSWw]) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
host=$1; shift
case $host in
{cases}
  *) echo "cluster agent: no node named $host (nodes: {names})" >&2; exit 255 ;;
esac
exec nsenter -t "$pid" --net --uts --ipc --mount --wd="$PWD" -- /bin/sh -c "$*"
"""


def _holder(name: str, hosts: Path, net: bool = True) -> subprocess.Popen[bytes]:
    """A process that holds a node's namespaces until its stdin closes."""
    flags = (["--net", "--uts", "--ipc", "--mount", "--propagation", "private"]
              if net else ["--net"])
    script = _HOLDER.format(name=name, hosts=hosts) if net else "echo ready\nread _\n"
    holder = subprocess.Popen(["unshare", *flags, "--fork", "--kill-child", "sh", "-c", script],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert holder.stdout is not None
    line = holder.stdout.readline()
    if line.strip() != b"ready":
        holder.kill()
        raise RuntimeError(f"cluster: node {name} did not start (its holder printed {line!r})")
    return holder


def _namespace_pid(holder: subprocess.Popen[bytes]) -> int:
    """The pid inside the namespaces: unshare --fork runs the holder's shell as its child."""
    children = Path(f"/proc/{holder.pid}/task/{holder.pid}/children").read_text().split()
    return int(children[0])


def _members(net_ns: str) -> list[int]:
    """Every process in the network namespace ``net_ns`` (its /proc link text)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(entry / "ns" / "net") == net_ns:
                    found.append(int(entry.name))
    return found


def _end(holders: list[subprocess.Popen[bytes]]) -> None:
    """End every holder and whatever still runs in its namespaces (a stuck rank)."""
    namespaces = []
    for holder in holders:
        with contextlib.suppress(OSError, IndexError):
            namespaces.append(os.readlink(f"/proc/{_namespace_pid(holder)}/ns/net"))
    for holder in holders:
        with contextlib.suppress(OSError):
            assert holder.stdin is not None
            holder.stdin.close()
    for net_ns in namespaces:
        for pid in _members(net_ns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for holder in holders:
        try:
            holder.wait(timeout=10)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()


@contextlib.contextmanager
def cluster(nodes: int = 2, link: str | None = None) -> Iterator[Cluster]:
    """``nodes`` nodes on a link of rate ``link`` (tc's syntax; None: unlimited)."""
    if nodes < 2:
        raise ValueError(f"a cluster: expected 2 nodes or more, got {nodes}")
    if link is not None:
        link_bits_per_second(link)
    reason = missing()
    if reason is not None:
        raise PermissionError(f"a cluster on this machine needs {reason}")
    tag = os.getpid() % 250 + 1
    names = [f"node{i}" for i in range(nodes)]
    addresses = [SUBNET.format(tag, i + 1) for i in range(nodes)]
    holders: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="mpigrad-cluster-") as state, \
            _ended_by_signals():
        try:
            hosts = Path(state, "hosts")
            hosts.write_text("127.0.0.1 localhost\n" + "".join(
                f"{address} {name}\n" for address, name in zip(addresses, names)))
            members = []
            for name, address in zip(names, addresses):
                holders.append(_holder(name, hosts))
                members.append(Node(name, address, _namespace_pid(holders[-1])))
            _wire(members, link, tag, holders)
            agent = Path(state, "agent")
            agent.write_text(_AGENT.format(names=" ".join(names), cases="\n".join(
                f"  {node.name}|{node.address}) pid={node.pid} ;;" for node in members)))
            agent.chmod(0o755)
            yield Cluster(tuple(members), agent, link)
        finally:
            _end(holders)


def _wire(nodes: list[Node], link: str | None, tag: int, holders: list[subprocess.Popen[bytes]]
          ) -> None:
    """One veth per node into a bridge (two nodes: one veth pair), rate-limited on each side."""
    pids = [node.pid for node in nodes]
    outer = [f"mgc{tag}n{i}" for i in range(len(nodes))]
    if len(nodes) == 2:
        _ip("link", "add", outer[0], "type", "veth", "peer", "name", outer[1])
        ends = list(zip(outer, pids))
    else:
        switch = _holder("switch", Path("/etc/hosts"), net=False)
        holders.append(switch)
        bridge = _namespace_pid(switch)
        _ip_in(bridge, "link", "add", "br0", "type", "bridge")
        _ip_in(bridge, "link", "set", "br0", "up")
        ends = []
        for i, pid in enumerate(pids):
            port = f"mgc{tag}s{i}"
            _ip("link", "add", outer[i], "type", "veth", "peer", "name", port)
            _ip("link", "set", port, "netns", str(bridge))
            _ip_in(bridge, "link", "set", port, "master", "br0")
            _ip_in(bridge, "link", "set", port, "up")
            ends.append((outer[i], pid))
    for (device, pid), node in zip(ends, nodes):
        _ip("link", "set", device, "netns", str(pid))
        _ip_in(pid, "link", "set", device, "name", INTERFACE)
        _ip_in(pid, "addr", "add", f"{node.address}/24", "dev", INTERFACE)
        _ip_in(pid, "link", "set", INTERFACE, "up")
        if link is not None:
            burst = max(256 * 1024, int(link_bits_per_second(link) / 8 / 1000))
            subprocess.run(["nsenter", "-t", str(pid), "--net", "tc", "qdisc", "add", "dev",
                            INTERFACE, "root", "tbf", "rate", link, "burst", str(burst),
                            "latency", "10ms"], check=True, capture_output=True)


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True)


def _ip_in(pid: int, *argv: str) -> None:
    subprocess.run(["nsenter", "-t", str(pid), "--net", "ip", *argv], check=True,
                   capture_output=True)


@contextlib.contextmanager
def _ended_by_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise here (as Ctrl-C does), so that teardown runs."""
    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mpigrad.bench.cluster",
        description="Run an MPI job on nodes made of namespaces on this machine, joined by a "
                    "rate-limited link; everything is torn down when it ends.")
    parser.add_argument("--nodes", type=int, default=None,
                        help="nodes (default 2, or as many as --ppn lists)")
    parser.add_argument("--ppn", default="2",
                        help="ranks per node, or a count per node (3,5,4,4: as many nodes) "
                             "(default 2)")
    parser.add_argument("--link", default=None,
                        help="link rate in tc's syntax, e.g. 2gbit (default: unlimited)")
    parser.add_argument("--mpiexec", default="mpiexec", help="the mpiexec to launch with")
    parser.add_argument("--check", action="store_true",
                        help="say what this machine lacks for a cluster (exit 1) or nothing (0)")
    parser.add_argument("--no-mpiexec", action="store_true",
                        help="run the command itself on node 0 (it launches its own jobs, "
                             "from_environment() gives their launch line)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the program and its args")
    args = parser.parse_args(argv)
    reason = missing()
    if args.check:
        print(f"a cluster on this machine needs {reason}" if reason else "a cluster can run here")
        return 1 if reason else 0
    counts = [int(c) for c in args.ppn.split(",")]
    per_node: int | list[int] = counts[0] if len(counts) == 1 else counts
    if len(counts) > 1:
        if args.nodes not in (None, len(counts)):
            parser.error(f"--ppn {args.ppn} places {len(counts)} nodes: got --nodes {args.nodes}")
        args.nodes = len(counts)
    args.nodes = 2 if args.nodes is None else args.nodes
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("expected a command after --")
    try:
        with cluster(args.nodes, args.link) as nodes:
            launch = command if args.no_mpiexec else nodes.mpiexec(per_node, args.mpiexec) + command
            print(f"cluster: {args.nodes} nodes x {args.ppn} ranks, link "
                  f"{args.link or 'unlimited'}: {shlex.join(launch)}", file=sys.stderr, flush=True)
            return subprocess.run(nodes.nodes[0].enter(launch), check=False,
                                  env={**os.environ, **nodes.environment(per_node)}).returncode
    except KeyboardInterrupt as stop:
        print(f"cluster: stopped ({stop or 'Ctrl-C'}); torn down", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
