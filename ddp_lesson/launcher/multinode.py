"""Several torchrun agents ("nodes") on one machine, to practise multi-node runs.

    nodes = multinode.start_nodes("rank_table.py", nnodes=2, nproc_per_node=1)
    results = multinode.wait_all(nodes)

Each node is one launch of the same spec.Spec but for its Nodes(N, i, 127.0.0.1:PORT, job id),
with its own run directory (<base>/node<i>): exactly what you would type on N machines,
with the machines' addresses replaced by 127.0.0.1. The c10d rendezvous lets the first
agent host the store; the others join it.
"""
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from . import devices, launch
from ..rank import rundir
from .runs import load
from .spec import Nodes, Spec


def start_nodes(script, nnodes=2, nproc_per_node=1, args=(), base_dir=None, timeout=None,
                env=None, port=None, rdzv_id=None):
    """Start `nnodes` agents for one job; returns their Runs (node 0 first)."""
    base = Path(base_dir) if base_dir else rundir.new_path(name=f"{Path(script).stem}-{nnodes}nodes")
    endpoint = f"127.0.0.1:{port or launch.free_port()}"
    job = rdzv_id or f"ddp-lesson-{base.name}"
    job_spec = Spec(script, devices.Request(nproc_per_node, cpu=True), args=args, timeout=timeout, env=env,
                    nodes=Nodes(nnodes, 0, endpoint, job))   # every node's input checked before any starts
    runs = []
    try:
        for i in range(nnodes):
            node = replace(job_spec, label=f"node{i}", nodes=replace(job_spec.nodes, rank=i))
            runs.append(launch.run(node, run_dir=base / f"node{i}"))
    except BaseException:
        for r in runs:
            r.stop()
        raise
    return runs


def wait_all(runs, timeout=None):
    """Wait for every node; a node that fails or times out stops the others."""
    end = None if timeout is None else time.monotonic() + timeout
    try:
        while not all(r.done() for r in runs):
            if any(r.done() and r.status != "ok" for r in runs):
                time.sleep(3)  # the others usually notice by themselves; then make sure
                for r in runs:
                    if not r.done():
                        r.stop()
                break
            if end is not None and time.monotonic() >= end:
                for r in runs:
                    r.stop()
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        for r in runs:
            r.stop()
        raise
    return [r.wait() for r in runs]


def rank_rows(runs):
    """One row per global rank: what each rank logged about itself, with its node."""
    rows = []
    for i, r in enumerate(runs):
        for row in load(r.run_dir).rows:
            if "group_rank" in row:
                rows.append({"node": i, "RANK": row["rank"], "LOCAL_RANK": row["local_rank"],
                             "GROUP_RANK": row["group_rank"], "WORLD_SIZE": row["world_size"],
                             "LOCAL_WORLD_SIZE": row["local_world_size"], "host": row["host"]})
    return sorted(rows, key=lambda x: x["RANK"])


def expected_table(nodes, procs_per_node):
    """The table torchrun produces on `nodes` machines with `procs_per_node` ranks each
    (node ranks as given; global rank = node * procs_per_node + local rank)."""
    world = nodes * procs_per_node
    return [{"NODE_RANK": n, "LOCAL_RANK": l, "RANK": n * procs_per_node + l, "WORLD_SIZE": world,
             "LOCAL_WORLD_SIZE": procs_per_node}
            for n in range(nodes) for l in range(procs_per_node)]


# --- two "machines" joined by a real link: network namespaces (root only) ---
def why_no_netns():
    """None where this process can make network namespaces, else one sentence why not."""
    if os.geteuid() != 0:
        return "Network namespaces need root."
    if not (shutil.which("ip") and shutil.which("unshare")):
        return "Network namespaces need iproute2's `ip` and util-linux's `unshare`."
    return None


class TwoMachines:
    """Two network namespaces, node0 (192.0.2.1) and node1 (192.0.2.2), joined by a veth
    pair named lesson0 on both sides: two machines on one network, as far as sockets can
    tell. With side_network=True each machine also has side0 (198.51.100.1, .2), its own
    second network that the other machine is not on, and its own name resolves to that
    address there: the classic multi-homed host, whose hostname maps to an interface the
    other machines cannot reach (a management network, docker0).

        with multinode.TwoMachines(side_network=True) as m:
            m.command(0, ["python", "-m", "ddp_lesson", "run", ...])   # argv to run on node0

    The namespace names are unique to this object; leaving the with-block deletes them
    (and their /etc/netns/<name>/hosts), whatever happened inside."""

    ADDRESSES = ("192.0.2.1", "192.0.2.2")
    SIDE_ADDRESSES = ("198.51.100.1", "198.51.100.2")
    IFNAME = "lesson0"

    def __init__(self, side_network=False):
        tag = f"ddpl{os.getpid()}{secrets.token_hex(2)}"
        self.names = (f"{tag}n0", f"{tag}n1")
        # the networks only node0, only node1 is on
        self.sides = (f"{tag}s0", f"{tag}s1") if side_network else ()
        self.hostnames = ("node0", "node1")

    def _ip(self, *args):
        out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")

    def _link(self, ns_a, ns_b, name_a, name_b):
        """A veth pair with one end in each namespace, renamed there."""
        tmp = (f"{ns_a[-6:]}x{name_a[:4]}", f"{ns_b[-6:]}y{name_a[:4]}")
        self._ip("link", "add", tmp[0], "type", "veth", "peer", "name", tmp[1])
        for ns, t, name in ((ns_a, tmp[0], name_a), (ns_b, tmp[1], name_b)):
            self._ip("link", "set", t, "netns", ns)
            self._ip("-n", ns, "link", "set", t, "name", name)
            self._ip("-n", ns, "link", "set", name, "up")

    def up(self):
        try:
            for ns in self.names + self.sides:
                self._ip("netns", "add", ns)
                self._ip("-n", ns, "link", "set", "lo", "up")
            self._link(*self.names, self.IFNAME, self.IFNAME)
            for ns, addr in zip(self.names, self.ADDRESSES):
                self._ip("-n", ns, "addr", "add", f"{addr}/24", "dev", self.IFNAME)
            own = list(self.ADDRESSES)
            for i, side in enumerate(self.sides):
                self._link(self.names[i], side, "side0", "side0")
                self._ip("-n", self.names[i], "addr", "add", f"{self.SIDE_ADDRESSES[i]}/24", "dev", "side0")
                own[i] = self.SIDE_ADDRESSES[i]
            # each machine's /etc/hosts (`ip netns exec` mounts /etc/netns/<name>/hosts there):
            # its own name at `own`, the other machine's at its lesson0 address
            views = ({"node0": own[0], "node1": self.ADDRESSES[1]},
                     {"node0": self.ADDRESSES[0], "node1": own[1]})
            for ns, view in zip(self.names, views):
                folder = Path("/etc/netns") / ns
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "hosts").write_text("127.0.0.1 localhost\n" +
                                              "".join(f"{a} {h}\n" for h, a in view.items()))
        except BaseException:
            self.down()
            raise
        return self

    def down(self):
        for ns in self.names + self.sides:
            # deleting a namespace ends its veth pairs; its processes are the caller's to end
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()

    def command(self, node, argv):
        """argv run inside machine `node` (0 or 1), under its own hostname (node0, node1)."""
        return ["ip", "netns", "exec", self.names[node], "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.hostnames[node], *map(str, argv)]

    def exists(self):
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return [ns for ns in self.names + self.sides if ns in listed.split()]

    def run(self, script, base_dir, nproc_per_node=1, args=(), timeout=60, env=None, port=29400):
        """One `python -m ddp_lesson run` per machine, meeting at node0:port; waits for both
        and returns their run directories (node0, node1), each with its result.json."""
        base = Path(base_dir)
        procs, dirs = [], []
        try:
            for node in (0, 1):
                dirs.append(base / f"node{node}")
                argv = [sys.executable, "-m", "ddp_lesson", "run", str(script), "--cpu",
                        "--nproc", str(nproc_per_node), "--nnodes", "2", "--node-rank", str(node),
                        "--rdzv-endpoint", f"node0:{port}", "--timeout", str(timeout),
                        "--run-dir", str(dirs[-1]), "--quiet", "--", *map(str, args)]
                procs.append(subprocess.Popen(self.command(node, argv), env=dict(os.environ, **(env or {})),
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            self.outputs = [p.communicate(timeout=timeout + 60)[0] for p in procs]
        finally:
            for p in procs:  # each launcher ends its own run's processes when it ends
                if p.poll() is None:
                    p.terminate()
                    p.wait()
        return dirs
