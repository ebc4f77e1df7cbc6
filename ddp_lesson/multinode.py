"""Several torchrun agents ("nodes") on one machine, to practise multi-node runs.

    nodes = multinode.start_nodes("rank_table.py", nnodes=2, nproc_per_node=1)
    results = multinode.wait_all(nodes)

Each node is one `launch.start(..., nnodes=N, node_rank=i, rdzv_endpoint=127.0.0.1:PORT)`
with its own run directory (<base>/node<i>): exactly what you would type on N machines,
with the machines' addresses replaced by 127.0.0.1. The c10d rendezvous lets the first
agent host the store; the others join it.
"""
import time
from pathlib import Path

from . import launch
from .runs import load, new_run_dir


def start_nodes(script, nnodes=2, nproc_per_node=1, args=(), base_dir=None, timeout=None,
                env=None, port=None, rdzv_id=None):
    """Start `nnodes` agents for one job; returns their Runs (node 0 first)."""
    base = Path(base_dir) if base_dir else new_run_dir(name=f"{Path(script).stem}-{nnodes}nodes")
    endpoint = f"127.0.0.1:{port or launch.free_port()}"
    job = rdzv_id or f"ddp-lesson-{base.name}"
    runs = []
    try:
        for i in range(nnodes):
            runs.append(launch.start(script, nproc=nproc_per_node, cpu=True, args=args,
                                     run_dir=base / f"node{i}", timeout=timeout, env=env,
                                     label=f"node{i}", nnodes=nnodes, node_rank=i,
                                     rdzv_endpoint=endpoint, rdzv_id=job))
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
