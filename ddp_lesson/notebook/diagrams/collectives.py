"""Pictures of what the ranks exchange: an all_reduce's values before and after, which
parameters land in which DDP bucket, and the index order each rank sees per epoch with and
without set_epoch. Each is drawn from real numbers (a run's tensors, a comm hook's buckets,
real DistributedSampler outputs); the one-line verdict under a picture is computed from those
numbers too, so a wrong input shows as a wrong verdict.
"""
import math

from matplotlib.figure import Figure

from .shapes import DEVICE_COLOURS, arrow, box

__all__ = ["all_reduce_before_after", "layers_to_buckets", "set_epoch_orders", "buffer_rule",
           "buffer_rule_verdict"]

BUCKET_COLOURS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3",
                  "#8C8C8C", "#CCB974", "#64B5CD"]


def _values(vs):
    return "  ".join(f"{v:+.4f}" for v in vs)


def _close(a, b):
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-7) for x, y in zip(a, b))


def all_reduce_verdict(before, after):
    """What `after` is, given every rank's `before`: the sum over ranks, the mean (the sum
    divided by the world size, what DDP does to gradients), or neither."""
    n = len(before)
    total = [sum(col) for col in zip(*before)]
    mean = [t / n for t in total]
    if all(_close(a, mean) for a in after) and (n == 1 or not _close(mean, total)):
        return f"after = (sum over the {n} ranks) / {n}: the mean, on every rank"
    if all(_close(a, mean) for a in after):   # n > 1 and sum = mean: both are zero
        return f"after = sum = mean = 0 over the {n} ranks (both zero: cannot tell which)"
    if all(_close(a, total) for a in after):
        return f"after = sum over the {n} ranks, on every rank (not divided)"
    return "after: neither the sum nor the mean of the ranks' values"


def all_reduce_before_after(before, after, what="values", title="all_reduce: before and after"):
    """`before[r]` and `after[r]`: rank r's numbers (a few values of one tensor) before and after
    the all-reduce, read from a real run. One row per rank; the verdict line says whether
    `after` is the sum or the mean of the ranks' `before`."""
    n = len(before)
    fig = Figure(figsize=(9.5, 1.3 + 0.55 * n))
    ax = fig.subplots()
    ax.set_xlim(0, 10)
    ax.set_ylim(-1.2, n + 0.4)
    ax.axis("off")
    ax.set_title(title, fontsize=11)
    ax.text(2.2, n + 0.05, f"before: each rank's own {what}", ha="center", fontsize=9, weight="bold")
    ax.text(7.8, n + 0.05, "after", ha="center", fontsize=9, weight="bold")
    for r in range(n):
        y = n - 1 - r
        c = DEVICE_COLOURS[r % len(DEVICE_COLOURS)]
        ax.text(-0.05, y + 0.35, f"rank {r}", color=c, fontsize=9, va="center", ha="left")
        box(ax, 0.8, y, 2.8, 0.7, _values(before[r]), c, fontsize=8)
        box(ax, 6.4, y, 2.8, 0.7, _values(after[r]), "#555555", alpha=0.12, fontsize=8)
        arrow(ax, 3.75, y + 0.35, 6.25, y + 0.35, colour="grey")
    ax.text(5.0, -0.35, "all_reduce", ha="center", fontsize=9, style="italic")
    ax.text(5.0, -0.95, all_reduce_verdict(before, after), ha="center", fontsize=9)
    fig.tight_layout()
    return fig


def _layer(name):
    return name.rsplit(".", 1)[0]    # "3.weight" -> "3": the module that owns the parameter


def bucket_order_verdict(params, buckets):
    """Whether the buckets, read in all-reduce order, hold the layers in reverse registration
    order (the order backward produces them for a model used front to back). Within one layer
    the order of weight and bias is backward's, so only the layers are compared."""
    flat = [p for b in buckets for p in b]
    if sorted(flat) != sorted(params):
        return "the buckets do not hold each parameter exactly once"
    if [_layer(p) for p in flat] == [_layer(p) for p in reversed(params)]:
        return "bucket 0 holds the last layer: layers in reverse registration order"
    return "not in reverse registration order"


def layers_to_buckets(params, buckets, first_step=None, title="which parameters land in which DDP bucket"):
    """`params`: parameter names in registration order (`model.named_parameters()`);
    `buckets[k]`: the names in bucket k, as DDP's comm hook received them (bucket 0 is
    all-reduced first); `first_step`: the same for the first backward, before DDP rebuilt its
    buckets (drawn as a left column when given). Each parameter is coloured by its bucket."""
    where = {p: k for k, b in enumerate(buckets) for p in b}
    rows = max(len(params), len(buckets))
    fig = Figure(figsize=(10 if first_step else 7.5, 1.4 + 0.3 * rows))
    ax = fig.subplots()
    ax.axis("off")
    ax.set_title(title, fontsize=11)
    ax.set_ylim(-1.6, rows + 0.6)
    x_params = 3.3 if first_step else 0.0
    ax.set_xlim(-0.2, x_params + 7.0)
    if first_step:
        ax.text(1.4, rows + 0.1, "first backward", ha="center", fontsize=9, weight="bold")
        h = rows / max(len(first_step), 1)
        for k, b in enumerate(first_step):
            y = rows - (k + 1) * h
            box(ax, 0.0, y + 0.1, 2.8, h - 0.2, f"bucket {k}\n{len(b)} parameters", "#8C8C8C",
                alpha=0.15, fontsize=8)
    ax.text(x_params + 1.3, rows + 0.1, "parameters, registration order", ha="center", fontsize=9,
            weight="bold")
    ax.text(x_params + 5.2, rows + 0.1, "buckets from step 2 (all-reduce order)", ha="center",
            fontsize=9, weight="bold")
    for i, p in enumerate(params):
        y = rows - 1 - i
        k = where.get(p)
        c = BUCKET_COLOURS[k % len(BUCKET_COLOURS)] if k is not None else "#FFFFFF"
        box(ax, x_params, y + 0.1, 2.6, 0.8, p, c, alpha=0.3, fontsize=8)
    h = rows / max(len(buckets), 1)
    for k, b in enumerate(buckets):
        y = rows - (k + 1) * h
        c = BUCKET_COLOURS[k % len(BUCKET_COLOURS)]
        box(ax, x_params + 3.6, y + 0.1, 3.2, h - 0.2, f"bucket {k}: " + ", ".join(b), c, alpha=0.3,
            fontsize=8)
        for p in b:
            if p in params:
                yp = rows - 1 - list(params).index(p) + 0.5
                arrow(ax, x_params + 2.65, yp, x_params + 3.55, y + h / 2, colour=c, style="-")
    ax.text(x_params + 3.4, -0.6, bucket_order_verdict(params, buckets), ha="center", fontsize=9)
    fig.tight_layout()
    return fig


def set_epoch_verdict(epochs):
    """`epochs[e][r]`: rank r's indices in epoch e. Compares every pair of epochs: all the same,
    all different, or which later epoch repeats which earlier one."""
    if all(e == epochs[0] for e in epochs):
        return "the same order every epoch"
    repeats = [(a, b) for b in range(len(epochs)) for a in range(b) if epochs[a] == epochs[b]]
    if not repeats:
        return "a new order every epoch"
    return "; ".join(f"epoch {b} repeats epoch {a}" for a, b in repeats)


def set_epoch_orders(orders, title="the index order each rank sees, epoch by epoch"):
    """`orders[name][e][r]`: the indices real DistributedSamplers gave rank r in epoch e, for each
    way of running the loop (for example without and with set_epoch). One row per epoch and
    rank, one box per index, coloured by rank; a verdict line per way."""
    width = max(len(s) for eps in orders.values() for e in eps for s in e)
    rows = sum(len(eps) * len(eps[0]) + 2 for eps in orders.values())
    fig = Figure(figsize=(2.0 + 0.5 * width, 0.8 + 0.32 * rows))
    ax = fig.subplots()
    ax.axis("off")
    ax.set_title(title, fontsize=11)
    y = 0.0
    for name, epochs in orders.items():
        ax.text(-2.6, y, name, fontsize=9, weight="bold", va="center")
        y -= 0.8
        for e, shares in enumerate(epochs):
            for r, share in enumerate(shares):
                c = DEVICE_COLOURS[r % len(DEVICE_COLOURS)]
                ax.text(-2.6, y, f"epoch {e}, rank {r}", fontsize=8, color=c, va="center")
                for k, i in enumerate(share):
                    box(ax, k * 0.6, y - 0.25, 0.5, 0.5, str(i), c, alpha=0.2, fontsize=8)
                y -= 0.65
            y -= 0.15
        ax.text(-2.6, y + 0.1, set_epoch_verdict(epochs), fontsize=8, style="italic", va="center")
        y -= 0.8
    ax.set_xlim(-2.7, 0.6 * width + 0.2)
    ax.set_ylim(y + 0.3, 0.5)
    fig.tight_layout()
    return fig


BUFFER_KINDS = {"train": ("training\nforward", DEVICE_COLOURS[0]),
                "eval": ("evaluation\nno_grad", "#8C8C8C")}


def buffer_rule_verdict(forwards):
    """One line: does each forward's copy follow the buffer rule (the first forward, or one
    after a training forward, copies), read from the measured `copied` or DDP's `decided`?"""
    got = [f["copied"] if f.get("copied") is not None else f["decided"] for f in forwards]
    want = [i == 0 or forwards[i - 1]["kind"] == "train" for i in range(len(forwards))]
    if got == want:
        return "each copy follows the forward before it: the first forward, or one after a training forward"
    bad = [i + 1 for i, (g, w) in enumerate(zip(got, want)) if g != w]
    return f"forwards {bad} break the rule: copied {[g for g in got]}"


def buffer_rule(forwards, title="which forwards start by copying rank 0's buffers"):
    """`forwards`: one dict per forward, in order, as ddp_checks.py measured it: `kind`
    ("train": gradients on, with backward; "eval": under torch.no_grad()), `copied` (the
    ranks' buffers equal at the start of the module's forward; None on one rank) and `decided`
    (DDP's will_sync_module_buffers() before it). A box per forward; a red "copy" tag above
    each that started with the copy; an arrow from the forward that decided it."""
    n = len(forwards)
    fig = Figure(figsize=(1.2 + 1.15 * n, 2.7))
    ax = fig.subplots()
    ax.axis("off")
    ax.set_title(title, fontsize=11)
    ax.set_xlim(-0.3, 1.15 * n)
    ax.set_ylim(-0.9, 2.3)
    for i, f in enumerate(forwards):
        label, colour = BUFFER_KINDS[f["kind"]]
        x = 1.15 * i
        box(ax, x, 0.0, 0.95, 0.9, f"{i + 1}\n{label}", colour, alpha=0.3, fontsize=8)
        copied = f["copied"] if f.get("copied") is not None else f["decided"]
        if copied:
            box(ax, x + 0.15, 1.25, 0.65, 0.45, "copy", "#C44E52", alpha=0.55, fontsize=8)
            src = "first" if i == 0 else "after training"
            ax.text(x + 0.475, 1.9, src, ha="center", fontsize=7)
        else:
            ax.text(x + 0.475, 1.45, "no copy", ha="center", fontsize=8, color="#555555")
        if i:
            arrow(ax, x - 0.2, 0.45, x - 0.02, 0.45, colour="#555555")
    ax.text(1.15 * n / 2 - 0.2, -0.55, buffer_rule_verdict(forwards), ha="center", fontsize=9)
    fig.tight_layout()
    return fig
