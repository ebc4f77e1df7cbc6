"""The drawing pieces every diagram uses: device colours, a labelled box, an arrow, a blank panel."""
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

DEVICE_COLOURS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


def box(ax, x, y, w, h, text, colour, alpha=0.25, fontsize=9):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc=colour, ec=colour,
                                alpha=alpha, lw=1.5))
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc="none", ec=colour, lw=1.5))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def arrow(ax, x0, y0, x1, y1, colour="black", text=None, style="-|>"):
    ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle=style, mutation_scale=12,
                                 color=colour, lw=1.2))
    if text:
        ax.text((x0 + x1) / 2 + 0.02, (y0 + y1) / 2, text, fontsize=8, va="center")


def blank(ax, title):
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.axis("off")
    ax.set_title(title, fontsize=11)


def rank_grid(ax, ranks, columns, centre, xlabel):
    """The frame of a rank x micro-batch grid (rank 0 on top, micro-batches numbered from 1,
    each label at `centre` within its column): the strips of 05 (sync_strip,
    accumulation_windows) share it."""
    ax.set_yticks([ranks - 1 - r + 0.35 for r in range(ranks)])
    ax.set_yticklabels([f"rank {r}" for r in range(ranks)], fontsize=9)
    ax.set_xticks([k + centre for k in range(columns)])
    ax.set_xticklabels([str(k + 1) for k in range(columns)], fontsize=8)
    ax.set_xlabel(xlabel, fontsize=9)
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
