"""Drawn diagrams for the first lessons: model parallel vs data parallel, the four steps of
nn.DataParallel (scatter, replicate, parallel_apply, gather), a DistributedSampler's shares,
a DDP step's timeline and which accumulation steps all-reduce.

Each figure is drawn from the data it is given (a real sampler's indices, a run's logged
rows), never from a formula, so it stays right at any world size.

Figures are matplotlib.figure.Figure objects (not pyplot), so nothing piles up in pyplot's
list of open figures; a notebook shows one with `ddp_lesson.notebook.lesson.show(fig)`.
"""
from matplotlib.figure import Figure

from .shapes import DEVICE_COLOURS, arrow, blank, box, rank_grid

__all__ = ['model_vs_data_parallel', 'data_parallel_steps', 'sampler_shares', 'ddp_timeline', 'sync_strip']


def model_vs_data_parallel():
    """Left: one model cut in two, a batch flowing through device 0 then device 1.
    Right: the whole model copied to two devices, each taking half of the batch."""
    fig = Figure(figsize=(10, 4.2))
    left, right = fig.subplots(1, 2)
    c0, c1 = DEVICE_COLOURS[:2]

    blank(left, "model parallel: the MODEL is split")
    box(left, 0.3, 0.86, 0.4, 0.09, "whole batch (64)", "grey")
    box(left, 0.15, 0.48, 0.7, 0.3, "", c0, alpha=0.1)
    left.text(0.17, 0.74, "device 0", color=c0, fontsize=9, weight="bold")
    box(left, 0.3, 0.62, 0.4, 0.08, "layers 1-2", c0)
    box(left, 0.3, 0.51, 0.4, 0.08, "(activations)", c0, alpha=0.05)
    box(left, 0.15, 0.08, 0.7, 0.3, "", c1, alpha=0.1)
    left.text(0.17, 0.34, "device 1", color=c1, fontsize=9, weight="bold")
    box(left, 0.3, 0.22, 0.4, 0.08, "layers 3-4", c1)
    box(left, 0.3, 0.11, 0.4, 0.08, "loss", c1, alpha=0.05)
    arrow(left, 0.5, 0.86, 0.5, 0.71)
    arrow(left, 0.5, 0.51, 0.5, 0.31, text="activations copied")
    left.text(0.5, 0.01, "fits a model too big for one device;\none device works while the other waits",
              ha="center", fontsize=8, style="italic")

    blank(right, "data parallel: the DATA is split")
    box(right, 0.3, 0.86, 0.4, 0.09, "whole batch (64)", "grey")
    for i, (x, c) in enumerate(((0.05, c0), (0.53, c1))):
        box(right, x, 0.2, 0.42, 0.55, "", c, alpha=0.1)
        right.text(x + 0.03, 0.69, f"device {i}", color=c, fontsize=9, weight="bold")
        box(right, x + 0.06, 0.56, 0.3, 0.08, f"samples {32 * i}-{32 * i + 31}", c, alpha=0.05)
        box(right, x + 0.06, 0.42, 0.3, 0.09, "full model copy", c)
        box(right, x + 0.06, 0.26, 0.3, 0.08, "gradients", c, alpha=0.05)
        arrow(right, 0.5, 0.86, x + 0.21, 0.65)
    arrow(right, 0.41, 0.3, 0.59, 0.3, style="<|-|>")
    right.text(0.5, 0.14, "average gradients\n(all-reduce)", ha="center", fontsize=8)
    right.text(0.5, 0.01, "every device holds the whole model;\nall work at once on different samples",
               ha="center", fontsize=8, style="italic")
    fig.tight_layout()
    return fig


def data_parallel_steps(chunk_sizes=(2, 2, 1), devices=4, scalar_loss=False):
    """nn.DataParallel's forward for one batch: rows are the steps, columns the devices.
    `chunk_sizes` as tensor.chunk gives them (fewer chunks than devices leaves some idle)."""
    n = sum(chunk_sizes)
    fig = Figure(figsize=(2.0 + 1.9 * devices, 5.2))
    ax = fig.subplots()
    ax.set_xlim(-1.6, devices)
    ax.set_ylim(-0.2, 5)
    ax.axis("off")
    ax.set_title(f"nn.DataParallel, batch of {n} on {devices} devices: "
                 f"chunks {list(chunk_sizes)}", fontsize=11)
    steps = ["input on\ndevice_ids[0]", "1 scatter\n(tensor.chunk)", "2 replicate\n(copy model)",
             "3 parallel_apply\n(one thread each)", "4 gather\n(cat on output_device)"]
    for row, label in enumerate(steps):
        ax.text(-1.5, 4.4 - row, label, fontsize=9, va="center")
    c0 = DEVICE_COLOURS[0]
    box(ax, 0.05, 4.15, 0.8, 0.5, f"batch [{n}]", c0)
    for d in range(devices):
        c = DEVICE_COLOURS[d % len(DEVICE_COLOURS)]
        ax.text(d + 0.45, 4.85, f"device {d}", ha="center", fontsize=9, color=c, weight="bold")
        if d < len(chunk_sizes):
            box(ax, d + 0.05, 3.15, 0.8, 0.5, f"chunk [{chunk_sizes[d]}]", c)
            arrow(ax, 0.45, 4.15, d + 0.45, 3.65, colour="grey")
            box(ax, d + 0.05, 2.15, 0.8, 0.5, f"replica {d}" if d else "replica 0\n(shares storage)", c)
            out = "loss ()" if scalar_loss else f"out [{chunk_sizes[d]}]"
            box(ax, d + 0.05, 1.15, 0.8, 0.5, out, c)
            arrow(ax, d + 0.45, 3.15, d + 0.45, 2.65, colour="grey")
            arrow(ax, d + 0.45, 2.15, d + 0.45, 1.65, colour="grey")
            arrow(ax, d + 0.45, 1.15, 0.45, 0.65, colour="grey")
        else:
            ax.text(d + 0.45, 2.4, "idle:\nno chunk left", ha="center", fontsize=9, color="grey")
    gathered = f"vector [{len(chunk_sizes)}]\n(warning!)" if scalar_loss else f"out [{n}]"
    box(ax, 0.05, 0.15, 0.8, 0.5, gathered, c0)
    ax.text(1.0, 0.4, "backward runs the same way in reverse: gradients of the replicas\n"
            "are summed into the module's parameters on device_ids[0]", fontsize=8, va="center")
    fig.tight_layout()
    return fig


def sampler_shares(n, rows):
    """Which samples each rank gets. `rows` maps a title to the per-rank index lists of a real
    DistributedSampler; a sample seen twice is red, a sample no rank sees is shown grey."""
    fig = Figure(figsize=(1.2 + 0.55 * max(n, 1), 0.5 + 0.5 * sum(len(r) + 1.4 for r in rows.values())))
    ax = fig.subplots()
    ax.axis("off")
    y = 0.0
    for title, shares in rows.items():
        seen = [i for share in shares for i in share]
        ax.text(-1.4, y, title, fontsize=9, weight="bold", va="center")
        y -= 0.8
        for rank, share in enumerate(shares):
            c = DEVICE_COLOURS[rank % len(DEVICE_COLOURS)]
            ax.text(-1.4, y, f"rank {rank}", fontsize=9, color=c, va="center")
            for k, i in enumerate(share):
                twice = seen.count(i) > 1
                box(ax, k * 0.6, y - 0.25, 0.5, 0.5, str(i), "#C44E52" if twice else c,
                     alpha=0.45 if twice else 0.2)
            y -= 0.7
        left_out = sorted(set(range(n)) - set(seen))
        repeats = sorted({i for i in seen if seen.count(i) > 1})
        ax.text(-1.4, y + 0.15, (f"repeated (red): {repeats}   " if repeats else "no repeats   ")
                + (f"seen by no rank this epoch: {left_out}" if left_out else "every sample seen"),
                fontsize=8, style="italic", va="center")
        y -= 0.9
    ax.set_xlim(-1.5, 0.6 * max(len(s) for r in rows.values() for s in r) + 0.2)
    ax.set_ylim(y + 0.3, 0.5)
    fig.tight_layout()
    return fig


def ddp_timeline(events, title="one DDP step on rank 0"):
    """A step as bars on a time axis. `events` is a list of (row, start_s, end_s, label) measured
    by a run (for example: backward, then one all-reduce per bucket); rows are drawn top down in
    the order they first appear."""
    rows = list(dict.fromkeys(e[0] for e in events))
    fig = Figure(figsize=(9, 1.0 + 0.32 * len(rows)))
    ax = fig.subplots()
    t0 = min(e[1] for e in events)
    for k, (row, start, end, label) in enumerate(events):
        y = len(rows) - 1 - rows.index(row)
        c = DEVICE_COLOURS[rows.index(row) % len(DEVICE_COLOURS)]
        ax.barh(y, (end - start) * 1e3, left=(start - t0) * 1e3, height=0.6, color=c, alpha=0.6,
                edgecolor=c)
        if label:
            ax.text((start - t0 + (end - start) / 2) * 1e3, y, label, ha="center", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(list(reversed(rows)), fontsize=9)
    ax.set_xlabel("ms since the step's backward started")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def sync_strip(synced):
    """Which micro-batches all-reduce. `synced[rank][k]` is True when micro-batch k of rank
    `rank` ran an all-reduce (from a run's logged rows); one row per rank, one cell per
    micro-batch."""
    ranks, steps = len(synced), max(len(s) for s in synced)
    fig = Figure(figsize=(1.6 + 0.45 * steps, 0.9 + 0.45 * ranks))
    ax = fig.subplots()
    for rank, row in enumerate(synced):
        for k, on in enumerate(row):
            box(ax, k, ranks - 1 - rank, 0.8, 0.7, "AR" if on else "", "#C44E52" if on else "grey",
                 alpha=0.55 if on else 0.1, fontsize=7)
    ax.set_xlim(-0.2, steps)
    ax.set_ylim(-0.2, ranks)
    rank_grid(ax, ranks, steps, 0.4, "micro-batch  (AR: its backward all-reduced)")
    fig.tight_layout()
    return fig
