"""Pictures of what a batch is under DDP: per-rank vs global BatchNorm statistics (notebook 04),
and accumulation windows, micro-batches grouped into optimizer steps (notebook 05).

Both are drawn from a run's own numbers: the values one BN channel saw on each rank and the
statistics the layers computed; the rows an accumulation loop logged per micro-batch. Every
drawn item carries a `gid` ("mean:rank0", "window:2", "micro:1:3", ...), so a test can find
it, read its position, colour and text back, and compare them with the input.
"""
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from .shapes import DEVICE_COLOURS, box, rank_grid

__all__ = ["bn_statistics", "accumulation_windows"]

GLOBAL_COLOUR = "#333333"


def _jitter(n, row):
    """Fixed vertical offsets for n dots (no randomness: the same figure every time)."""
    return [row + 0.28 * (((i * 7919) % 97) / 96 - 0.5) for i in range(n)]


def bn_statistics(values, rank_stats, sync_stats, title="one BatchNorm channel, one training step"):
    """Per-rank vs global BatchNorm statistics.

    values[r]: the values one channel of one BN layer saw on rank r (its own micro-batch);
    rank_stats[r]: (mean, biased var) that plain BatchNorm computed on rank r;
    sync_stats: (mean, biased var) that SyncBatchNorm computed (the same on every rank).
    One row per rank (its values as dots, its mean as a tick, mean +- std as a bar), and a last
    row with every rank's values and SyncBN's statistics; a dashed line marks SyncBN's mean."""
    ranks = len(values)
    fig = Figure(figsize=(8.5, 1.2 + 0.62 * (ranks + 1)))
    ax = fig.subplots()
    pooled = [v for vs in values for v in vs]
    rows = [(f"rank {r}", values[r], rank_stats[r], DEVICE_COLOURS[r % len(DEVICE_COLOURS)], f"rank{r}")
            for r in range(ranks)]
    rows.append(("SyncBN, all ranks", pooled, sync_stats, GLOBAL_COLOUR, "sync"))
    for k, (name, vs, (mean, var), colour, key) in enumerate(rows):
        y = ranks - k                       # rank 0 on top, the global row at the bottom
        ax.scatter(list(vs), _jitter(len(vs), y), s=4, color=colour, alpha=0.35, linewidths=0,
                   gid=f"values:{key}")
        std = var ** 0.5
        ax.plot([mean - std, mean + std], [y, y], color=colour, lw=2.5, solid_capstyle="butt",
                gid=f"std:{key}")
        ax.plot([mean, mean], [y - 0.3, y + 0.3], color=colour, lw=3, gid=f"mean:{key}")
        ax.text(1.01, y, f"{name}\nmean {mean:.3f}, var {var:.3f}  ({len(vs)} values)",
                transform=ax.get_yaxis_transform(), va="center", fontsize=8.5, color=colour,
                gid=f"label:{key}")
    ax.axvline(sync_stats[0], color=GLOBAL_COLOUR, ls="--", lw=1, gid="sync-mean-line")
    ax.set_yticks([])
    ax.set_ylim(-0.6, ranks + 0.6)
    ax.set_xlabel("value of the channel (dots), mean (tick) and mean \u00b1 std (bar)", fontsize=9)
    ax.set_title(title, fontsize=10)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    fig.subplots_adjust(left=0.03, right=0.7, bottom=0.22 if ranks < 3 else 0.15)
    return fig


def accumulation_windows(rows):
    """Micro-batches grouped into optimizer steps, from an accumulation loop's logged rows.

    rows[r] is rank r's list of per-micro-batch rows in order, each with `micro_batch`
    (1, 2, ...), `step` (the optimizer step it belongs to), `window` (the micro-batches in
    that step: what its loss was divided by) and `all_reduces` (how many DDP launched in its
    forward and backward). One shaded band per window, one row per rank, one cell per
    micro-batch: red "AR" where it all-reduced, grey where it ran under no_sync."""
    ranks, first = len(rows), rows[0]
    n = len(first)
    windows = {}
    for row in first:
        windows.setdefault(row["step"], []).append(row)
    fig = Figure(figsize=(1.8 + 0.6 * n, 1.5 + 0.5 * ranks))
    ax = fig.subplots()
    for step, members in windows.items():
        start = members[0]["micro_batch"] - 1
        size = len(members)
        ax.add_patch(Rectangle((start - 0.05, -0.25), size - 0.1, ranks + 0.2, fc="#DDDDDD",
                               ec="#888888", lw=1, gid=f"window:{step}"))
        ax.text(start + (size - 0.1) / 2 - 0.05, ranks + 0.25,
                f"optimizer step {step}\nloss \u00f7 {members[0]['window']}",
                ha="center", va="bottom", fontsize=8, gid=f"window-label:{step}")
    for rank, rank_rows in enumerate(rows):
        y = ranks - 1 - rank
        for row in rank_rows:
            on = row["all_reduces"] > 0
            x = row["micro_batch"] - 1
            box(ax, x + 0.05, y, 0.8, 0.7, "AR" if on else "", "#C44E52" if on else "grey",
                alpha=0.6 if on else 0.12, fontsize=7)
            cell = f"{rank}:{row['micro_batch']}"
            ax.patches[-2].set_gid(f"micro-fill:{cell}")
            ax.patches[-1].set_gid(f"micro:{cell}")
            ax.texts[-1].set_gid(f"micro-text:{cell}")
    ax.set_xlim(-0.3, n + 0.1)
    ax.set_ylim(-0.4, ranks + 1.0)
    rank_grid(ax, ranks, n, 0.45, "micro-batch   (AR: its backward all-reduced; grey: it ran under no_sync)")
    fig.tight_layout()
    return fig
