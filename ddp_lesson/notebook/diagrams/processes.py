"""Pictures of where a run's processes and devices are: the process tree of a real run, and
how CUDA_VISIBLE_DEVICES renumbers physical GPUs as cuda:0, cuda:1, ...

Both are drawn from the numbers they are given (a run's pids and ranks, a real
CUDA_VISIBLE_DEVICES string), so they stay right at any world size. The arrows carry gids
("start:rank3", "map:2->0") so a test can read back what was drawn.
"""
from matplotlib.figure import Figure

from ...launcher.devices import visible_ids   # the one parser of CUDA_VISIBLE_DEVICES
from .shapes import DEVICE_COLOURS, arrow, blank, box

__all__ = ["process_tree", "cuda_renumbering", "visible_ids"]


def _tag(ax, gid):
    """Name the patch just drawn, so tests can find it."""
    ax.patches[-1].set_gid(gid)


def process_tree(kernel_pid, agent_pid, ranks, store=None, run_dir=None, agent_ports=None,
                 world_size=None, warm_pid=None):
    """The process tree of one run on one machine (node), and the stores its processes meet at.

    kernel_pid: this notebook's kernel, where ddp_lesson supervises the run;
    agent_pid: the torchrun agent it started; ranks: dicts with `rank`, `local_rank`, `pid`
    (and `parent`, the pid that started it, if known: it must be the agent). The node's local
    ranks are 0 .. n-1; its ranks are any n distinct ranks of the job, as on node 1 of 2;
    store: "host:port" of the ranks' store, MASTER_ADDR:MASTER_PORT; without it, as in 00's
    section 2, the picture draws no store and its legend names none;
    agent_ports: the ports the agent listens on, if known. Then the ranks' store is the
    agent's when its port is one of them, else rank 0's; the agent's other port is the
    rendezvous store, where the agents meet (torch 2.14: DynamicRendezvousHandler);
    run_dir: the run directory's name, where logs and metrics flow back to the kernel;
    world_size: the job's, when this node holds only some of its ranks;
    warm_pid: the warm process, if the launch was warm: the kernel started it before the run,
    with torch already imported, and it forked the agent. The picture then draws it as a box
    between the kernel and the agent; without it the kernel starts the agent itself."""
    ranks = sorted(ranks, key=lambda r: r["rank"])
    numbers = [r["rank"] for r in ranks]
    if len(set(numbers)) != len(numbers) or min(numbers, default=0) < 0:
        raise ValueError(f"the ranks of one run are distinct numbers from 0, got {numbers}")
    local = sorted(r["local_rank"] for r in ranks)
    if local != list(range(len(ranks))):
        raise ValueError(f"the local ranks of one node are 0 .. n-1, got {local}")
    n = len(ranks)
    world_size = world_size or n
    if max(numbers, default=-1) >= world_size:
        raise ValueError(f"rank {max(numbers)} does not exist in a world of size {world_size}")
    wrong = [r["rank"] for r in ranks if r.get("parent", agent_pid) != agent_pid]
    if wrong:
        raise ValueError(f"rank(s) {wrong} were not started by the agent (pid {agent_pid})")
    port = int(store.rsplit(":", 1)[1]) if store else None
    rdzv_ports = [p for p in agent_ports or () if p != port]
    store_host = None if agent_ports is None else "agent" if port in agent_ports else "rank 0"
    # a warm launch adds a band for the warm process between the kernel and the agent: the
    # canvas grows by `lift` at the top, and the kernel and the run directory move up with it
    lift = 0.0 if warm_pid is None else 0.24
    fig = Figure(figsize=(max(8.0, 1.6 * n + 3.5), 5.4 * (1 + lift)))
    ax = fig.subplots()
    title = f"the process tree of a run: world size {world_size}"
    blank(ax, title if world_size == n else title + f", {n} rank(s) on this node")
    ax.set_ylim(0, 1 + lift)
    grey = "#8C8C8C"

    # the kernel, top left; the run directory, top right
    top = 0.80 + lift
    box(ax, 0.02, top, 0.36, 0.14, f"Jupyter kernel (this notebook)\npid {kernel_pid}\n"
                                   "ddp_lesson supervises the run", grey)
    _tag(ax, "box:kernel")
    box(ax, 0.66, top, 0.32, 0.14, f"run directory\n{run_dir or 'runs/...'}\nlogs/   metrics/", grey,
        alpha=0.1)
    _tag(ax, "box:run_dir")
    arrow(ax, 0.66, top + 0.07, 0.39, top + 0.07, colour=grey, text=None)
    _tag(ax, "flow:run_dir->kernel")
    ax.text(0.525, top + 0.09, "the kernel reads them", ha="center", fontsize=8)

    # a warm launch: the kernel started the warm process before the run; it forks the agent
    if warm_pid is not None:
        box(ax, 0.04, 0.78, 0.26, 0.14, f"warm process\npid {warm_pid}\ntorch imported", grey, alpha=0.15)
        _tag(ax, "box:warm")
        arrow(ax, 0.17, top, 0.17, 0.925)
        _tag(ax, "start:warm")
        ax.text(0.18, (top + 0.925) / 2, "started it once, ahead of the runs", fontsize=8, va="center")

    # the agent, and the stores: the agents' rendezvous store, the ranks' store
    box(ax, 0.04, 0.50, 0.26, 0.14, f"torchrun agent\npid {agent_pid}\none per node (machine)", "black",
        alpha=0.08)
    _tag(ax, "box:agent")
    parent_y = top if warm_pid is None else 0.78
    arrow(ax, 0.17, parent_y, 0.17, 0.645)
    _tag(ax, "start:agent")
    ax.text(0.18, (parent_y + 0.645) / 2, "starts" if warm_pid is None else "forks the agent",
            fontsize=8, va="center")
    if rdzv_ports:
        box(ax, 0.35, 0.60, 0.28, 0.10, "rendezvous store: the agents meet\nport "
            + ", ".join(map(str, rdzv_ports)), "black", alpha=0.03, fontsize=8)
        _tag(ax, "box:rdzv")
        arrow(ax, 0.31, 0.60, 0.34, 0.63, style="-")
        _tag(ax, "hosts:rdzv")
    if store:
        box(ax, 0.35, 0.40, 0.28, 0.10, f"ranks' store: the ranks meet\n{store}", "black", alpha=0.03,
            fontsize=8)
        _tag(ax, "box:store")
        if store_host == "agent":
            arrow(ax, 0.31, 0.54, 0.34, 0.47, style="-")
            _tag(ax, "hosts:store")
        ax.text(0.31, 0.565, "hosts", fontsize=7)

    # the ranks, one box each
    w = min(0.2, 0.9 / n - 0.04)
    gap = (1 - n * w) / (n + 1)
    for i, r in enumerate(ranks):
        x = gap + i * (w + gap)
        c = DEVICE_COLOURS[r["rank"] % len(DEVICE_COLOURS)]
        box(ax, x, 0.06, w, 0.2, f"rank {r['rank']}\nlocal rank {r['local_rank']}\npid {r['pid']}", c,
            fontsize=8 if n <= 6 else 7)
        _tag(ax, f"box:rank{r['rank']}")
        arrow(ax, 0.17, 0.50, x + w / 2, 0.265, colour="black")
        _tag(ax, f"start:rank{r['rank']}")
        if store:
            arrow(ax, x + w * 0.8, 0.265, 0.49, 0.395, colour=c, style="-", text=None)
            _tag(ax, f"meet:rank{r['rank']}")
        if store and store_host == "rank 0" and r["rank"] == 0:
            arrow(ax, x + w * 0.2, 0.265, 0.38, 0.395, style="-")
            _tag(ax, "hosts:store")
            ax.text(x + w * 0.2 + 0.02, 0.30, "hosts", fontsize=7)
        arrow(ax, x + w / 2 + 0.02, 0.265, 0.82, top - 0.005, colour=grey, style="-|>")
        _tag(ax, f"flow:rank{r['rank']}->run_dir")
        ax.patches[-1].set_linestyle(":")
    legend = ("black: who starts whom" + (", and who hosts a store;  " if store or rdzv_ports else ";  ")
              + ("coloured: the ranks meet at their store;  " if store else ""))
    ax.text(0.5, 0.005, legend + "dotted: logs and metrics written to files", ha="center",
            fontsize=8, style="italic")
    fig.tight_layout()
    return fig


def cuda_renumbering(cuda_visible_devices, n_physical=8, names=None):
    """Physical GPUs (as nvidia-smi numbers them) on top, the process's logical cuda:i below,
    an arrow from each visible physical GPU to its logical id. `names`: optional physical
    GPU names, one per id."""
    ids = visible_ids(cuda_visible_devices, n_physical)
    fig = Figure(figsize=(max(6.0, 1.0 * n_physical + 1.5), 3.4))
    ax = fig.subplots()
    blank(ax, f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}: "
              f"{len(ids)} of {n_physical} GPUs visible")
    w = 0.9 / n_physical - 0.045
    gap = (1 - n_physical * w) / (n_physical + 1)

    def x_of(i):
        return gap + i * (w + gap)

    ax.text(0.0, 0.93, "physical (nvidia-smi)", fontsize=8, style="italic")
    for g in range(n_physical):
        shown = g in ids
        c = DEVICE_COLOURS[ids.index(g) % len(DEVICE_COLOURS)] if shown else "#BBBBBB"
        label = f"GPU {g}" + (f"\n{names[g]}" if names else "") + ("" if shown else "\nhidden")
        box(ax, x_of(g), 0.66, w, 0.22, label, c, alpha=0.3 if shown else 0.1, fontsize=8)
    ax.text(0.0, 0.36, "logical (inside the process)", fontsize=8, style="italic")
    for j, g in enumerate(ids):
        c = DEVICE_COLOURS[j % len(DEVICE_COLOURS)]
        box(ax, x_of(j), 0.08, w, 0.2, f"cuda:{j}", c, fontsize=8)
        arrow(ax, x_of(g) + w / 2, 0.655, x_of(j) + w / 2, 0.285, colour=c)
        _tag(ax, f"map:{g}->{j}")
    fig.tight_layout()
    return fig
