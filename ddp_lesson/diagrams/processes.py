"""Pictures of where a run's processes and devices are: the process tree of a real run, and
how CUDA_VISIBLE_DEVICES renumbers physical GPUs as cuda:0, cuda:1, ...

Both are drawn from the numbers they are given (a run's pids and ranks, a real
CUDA_VISIBLE_DEVICES string), so they stay right at any world size. The arrows carry gids
("start:rank3", "map:2->0") so a test can read back what was drawn.
"""
from matplotlib.figure import Figure

from .shapes import DEVICE_COLOURS, arrow, blank, box

__all__ = ["process_tree", "cuda_renumbering", "visible_ids"]


def _tag(ax, gid):
    """Name the patch just drawn, so tests can find it."""
    ax.patches[-1].set_gid(gid)


def process_tree(kernel_pid, agent_pid, ranks, store=None, run_dir=None):
    """The process tree of one run on one machine (node).

    kernel_pid: this notebook's kernel, where ddp_lesson supervises the run;
    agent_pid: the torchrun agent it started; ranks: dicts with `rank`, `local_rank`, `pid`
    (and `parent`, the pid that started it, if known: it must be the agent);
    store: "host:port" of the rendezvous store the ranks met at (MASTER_ADDR:MASTER_PORT);
    run_dir: the run directory's name, where logs and metrics flow back to the kernel."""
    ranks = sorted(ranks, key=lambda r: r["rank"])
    numbers = [r["rank"] for r in ranks]
    if numbers != list(range(len(ranks))):
        raise ValueError(f"the ranks of one run are 0 .. world size - 1, got {numbers}")
    wrong = [r["rank"] for r in ranks if r.get("parent", agent_pid) != agent_pid]
    if wrong:
        raise ValueError(f"rank(s) {wrong} were not started by the agent (pid {agent_pid})")
    n = len(ranks)
    fig = Figure(figsize=(max(8.0, 1.6 * n + 3.5), 5.0))
    ax = fig.subplots()
    blank(ax, f"the process tree of a run: world size {n}")
    grey = "#8C8C8C"

    # the kernel, top left; the run directory, top right
    box(ax, 0.02, 0.80, 0.36, 0.14, f"Jupyter kernel (this notebook)\npid {kernel_pid}\n"
                                    "ddp_lesson supervises the run", grey)
    box(ax, 0.66, 0.80, 0.32, 0.14, f"run directory\n{run_dir or 'runs/...'}\nlogs/   metrics/", grey,
        alpha=0.1)
    arrow(ax, 0.66, 0.87, 0.39, 0.87, colour=grey, text=None)
    _tag(ax, "flow:run_dir->kernel")
    ax.text(0.525, 0.89, "the kernel reads them", ha="center", fontsize=8)

    # the agent and the store it hosts
    box(ax, 0.08, 0.50, 0.30, 0.14, f"torchrun agent\npid {agent_pid}\none per node (machine)", "black",
        alpha=0.08)
    arrow(ax, 0.2, 0.80, 0.2, 0.645)
    _tag(ax, "start:agent")
    ax.text(0.21, 0.72, "starts", fontsize=8)
    if store:
        box(ax, 0.46, 0.52, 0.24, 0.10, f"store (rendezvous)\n{store}", "black", alpha=0.03)
        arrow(ax, 0.39, 0.57, 0.45, 0.57, style="-")
        _tag(ax, "hosts:store")
        ax.text(0.40, 0.595, "hosts", fontsize=7)

    # the ranks, one box each
    w = min(0.2, 0.9 / n - 0.04)
    gap = (1 - n * w) / (n + 1)
    for i, r in enumerate(ranks):
        x = gap + i * (w + gap)
        c = DEVICE_COLOURS[r["rank"] % len(DEVICE_COLOURS)]
        box(ax, x, 0.08, w, 0.2, f"rank {r['rank']}\nlocal rank {r['local_rank']}\npid {r['pid']}", c,
            fontsize=8 if n <= 6 else 7)
        arrow(ax, 0.23, 0.50, x + w / 2, 0.285, colour="black")
        _tag(ax, f"start:rank{r['rank']}")
        if store:
            arrow(ax, x + w * 0.8, 0.285, 0.58, 0.505, colour=c, style="-", text=None)
            _tag(ax, f"meet:rank{r['rank']}")
        arrow(ax, x + w / 2 + 0.02, 0.285, 0.82, 0.795, colour=grey, style="-|>")
        _tag(ax, f"flow:rank{r['rank']}->run_dir")
        ax.patches[-1].set_linestyle(":")
    ax.text(0.5, 0.01, "black: who starts whom;  coloured: the ranks meet at the store;  "
                       "dotted: logs and metrics written to files", ha="center", fontsize=8,
            style="italic")
    fig.tight_layout()
    return fig


def visible_ids(cuda_visible_devices, n_physical):
    """The physical GPU ids a CUDA_VISIBLE_DEVICES string makes visible, in order, read the
    way torch.cuda reads it (_parse_visible_devices, then device_count): the list stops at the
    first entry that is not a GPU of this machine, and a repeated id hides every GPU."""
    ids = []
    for part in cuda_visible_devices.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) >= n_physical:
            break
        if int(part) in ids:
            return []
        ids.append(int(part))
    return ids


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
