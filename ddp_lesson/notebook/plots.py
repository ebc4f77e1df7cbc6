"""Plots of runs read back from their run directories, so a comparison survives a kernel
restart. One function, `draw_metric`, draws metric rows into axes; the static plots and the
run panel's live plot both use it.

    plots.plot_run("runs/...")                      # loss, test accuracy, time per step
    plots.compare_runs([a, b], metric="loss", labels=["DDP", "DDP + SyncBN"])
    plots.speedup_bars({"1 process": 20.0, "2 processes": 11.0})

Figures are made with matplotlib.figure.Figure, not pyplot: nothing piles up in pyplot's
list of open figures (no double display in Jupyter, nothing to close), and a figure can be
drawn off the main thread.
"""
import io
import math
import textwrap

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..rank import metrics as metrics_mod
from ..launcher import runs as runs_mod

LABELS = dict(metrics_mod.LABELS)  # axis labels come from the scripts' one metric vocabulary
MAX_RANK_LABELS = 8  # past this many ranks the legend would drown the plot
DENSE = 30           # a curve with at least this many points per rank is drawn smoothed
TIME_COLORS = {"data_s": "#8c8c8c", "compute_s": "#1f77b4", "wait_s": "#d62728"}
TIME_NAMES = {"data_s": "data", "compute_s": "compute", "wait_s": "waiting for others"}


def _record(run):
    """A RunRecord from a run directory, a RunRecord, or a launch.Run."""
    if isinstance(run, runs_mod.RunRecord):
        return run
    return runs_mod.load(getattr(run, "run_dir", run))


class Series:
    """One metric of a run, per rank and averaged over ranks; rows can be added as they
    arrive, so a live plot does not recompute everything each frame.

    The mean is taken per step over the ranks that logged that step; against time it is
    placed at the ranks' mean time for that step."""

    def __init__(self, metric, x="step", t0=None):
        self.metric, self.x, self.t0 = metric, x, t0
        self.per_rank = {}   # rank -> ([x], [y])
        self._steps = runs_mod.PerStep()

    def add(self, rows):
        metric, x = self.metric, self.x
        if x == "time" and self.t0 is None:
            self.t0 = min((r["time"] for r in rows if metric in r and "time" in r), default=None)
        for r in rows:
            y = r.get(metric)
            step = r.get("step")
            if y is None or step is None:
                continue
            xv = r["time"] - self.t0 if x == "time" else r.get(x)
            if xv is None:
                continue
            xs, ys = self.per_rank.setdefault(r.get("rank"), ([], []))
            xs.append(xv)
            ys.append(y)
            self._steps.add(step, y, x=xv)
        return self

    def mean(self):
        _, xs, ys = self._steps.reduce("mean")
        return xs, ys

    def __len__(self):
        return sum(len(v[0]) for v in self.per_rank.values())


def series(rows, metric, x="step", t0=None):
    """({rank: ([x], [y])}, ([x], [mean y over ranks])) for one metric of `rows`."""
    s = Series(metric, x=x, t0=t0).add(rows)
    return s.per_rank, s.mean()


def _thin(xs, ys, max_points):
    """Every k-th point, so a long run draws as fast as a short one (a line cannot show
    more points than the axes have pixels anyway); the last point is always kept."""
    n = len(xs)
    if n <= max_points:
        return xs, ys
    k = -(-n // max_points)
    idx = list(range(0, n, k))
    if idx[-1] != n - 1:
        idx.append(n - 1)
    return [xs[i] for i in idx], [ys[i] for i in idx]


def smooth_half(n, points=None):
    """Half the window `smooth` uses on n points; 0: the curve stays as it is (under 40 points)."""
    return (points or max(1, min(50, n // 20))) // 2


def _log_if_wide(ax, metric, lines):
    """A loss that spans 100x or more, all positive, goes on a log axis: a fall from 27 to
    0.01, or a blow-up to 1e22, then shows every rank's line instead of a flat one."""
    ys = [y for *_, line_ys, _ in lines for y in line_ys if y is not None and math.isfinite(y)]
    wide = "loss" in metric and ys and min(ys) > 0 and max(ys) >= 100 * min(ys)
    ax.set_yscale("log" if wide else "linear")


def smooth(ys, points=None):
    """Centred moving mean over about 1/20 of the curve (at most 50 points; fewer at the
    ends), so a per-step curve of tiny batches shows its trend; short curves stay as they are."""
    n = len(ys)
    half = smooth_half(n, points)
    if half < 1:
        return list(ys)
    c = np.concatenate([[0.0], np.cumsum(np.asarray(ys, dtype=float))])
    i = np.arange(n)
    lo, hi = np.maximum(i - half, 0), np.minimum(i + half + 1, n)
    return list((c[hi] - c[lo]) / (hi - lo))


def draw_metric(ax, rows, metric, x="step", t0=None, ranks=True, mean=True, label=None,
                color=None, max_points=1500):
    """Draw one metric into `ax`: a thin line per rank and the mean over ranks (rows, or a
    Series). Returns the number of points. Metrics logged rarely (accuracy once an epoch)
    get markers so that a single point still shows; curves logged every step (DENSE points
    or more) are drawn as faint raw lines under the mean smoothed by `smooth`.

    Drawing again into the same axes with the same lines only replaces their data (and
    rescales), which keeps a live plot cheap; anything else starts the axes afresh."""
    s = rows if isinstance(rows, Series) else Series(metric, x=x, t0=t0).add(rows)
    per_rank = s.per_rank
    rank_ids = sorted(per_rank, key=lambda r: (r is None, r if r is not None else 0))
    longest = max((len(v[0]) for v in per_rank.values()), default=0)
    sparse = longest < DENSE
    smoothed = not sparse and smooth_half(longest) >= 1   # a 30-step curve is drawn as it is
    lines = []  # (key, label, xs, ys, kwargs)
    if ranks and (len(rank_ids) > 1 or not mean or not sparse):
        many = len(rank_ids) > MAX_RANK_LABELS
        for i, rank in enumerate(rank_ids):
            name = ("each rank" if i == 0 else None) if many else \
                (f"rank {rank}" if rank is not None else "reduced")
            if smoothed and mean:
                name = f"{name}, raw" if name and len(rank_ids) > 1 else ("raw" if i == 0 else None)
            lines.append((rank, name, *per_rank[rank],                 # faint only under a smoothed mean
                          {"lw": 0.8 if smoothed else 1.2, "alpha": 0.3 if smoothed else 0.7}))
    mx, my = s.mean() if mean else ([], [])
    if mx:
        name = label or ("mean over ranks" if len(rank_ids) > 1 else f"rank {rank_ids[0]}")
        if smoothed:
            my, name = smooth(my), f"{name}, smoothed"
        lines.append(("mean", name, mx, my,
                      {"lw": 1.8, "color": color or ("black" if ranks else None)}))
    keys = (metric, x, sparse, tuple((k, n) for k, n, *_ in lines))
    cache = getattr(ax, "_ddp_lesson_lines", None)
    if cache and cache[0] == keys:
        for line, (_, _, xs, ys, _) in zip(cache[1], lines):
            line.set_data(*_thin(xs, ys, max_points))
        ax.relim()
        _log_if_wide(ax, metric, lines)
        ax.autoscale_view()
        return len(s)
    ax.clear()
    style = {"marker": "o", "markersize": 3} if sparse else {}
    artists = [ax.plot(*_thin(xs, ys, max_points), label=name, **kw, **style)[0]
               for _, name, xs, ys, kw in lines]
    ax._ddp_lesson_lines = (keys, artists)
    ax.set_xlabel(LABELS.get(x, x))
    ax.set_ylabel(LABELS.get(metric, metric))
    _log_if_wide(ax, metric, lines)
    ax.grid(True, alpha=0.3)
    if lines:
        # "best" scans every drawn point: a few ms for 8 thinned lines of max_points. A rising
        # accuracy curve ends in the upper right, so there it is always "best"; a long loss
        # curve falls, away from the upper right, which costs nothing to place
        ax.legend(fontsize="small", loc="best" if sparse or "accuracy" in metric else "upper right")
    else:
        ax.text(0.5, 0.5, f"no '{metric}' rows yet", ha="center", va="center",
                transform=ax.transAxes, color="gray")
    return len(s)


def step_times_label(times):
    """The bars' x label, naming the steps the medians really cover: the last min(window, n)."""
    n = max((len(keys["compute_s"]) for keys in times.per_rank.values()), default=0)
    if not n:
        return "ms per step (median)"
    return f"ms per step (median of the last {n} step{'s' if n != 1 else ''})"


def draw_step_times(ax, times, stragglers):
    """Per rank, a stacked horizontal bar of the median step: data / compute / waiting for
    others (ms), memory at the bar's end, the `stragglers` named. `times`: a runs.StepTimes, or
    rows. It draws a verdict, never judges: the stragglers come from whoever judged the same
    times (monitor.Monitor live, RunRecord.stragglers() after the run). Redraws the axes (a
    few bars cost little)."""
    times = times if isinstance(times, runs_mod.StepTimes) else runs_mod.StepTimes().add(times)
    med = times.medians()
    slow = set(stragglers)
    ax.clear()
    ax.set_xlabel(step_times_label(times))
    if not med:
        ax.text(0.5, 0.5, "no compute_s rows yet", ha="center", va="center",
                transform=ax.transAxes, color="gray")
        return med
    ranks = list(med)
    left = [0.0] * len(ranks)
    for key in runs_mod.TIME_KEYS:
        widths = [1000 * med[r][key] for r in ranks]
        ax.barh(range(len(ranks)), widths, left=left, color=TIME_COLORS[key], label=TIME_NAMES[key])
        left = [a + b for a, b in zip(left, widths)]
    for i, r in enumerate(ranks):
        mem = times.mem_mb.get(r)
        if mem is not None:
            ax.annotate(f" {mem:.0f} MB", (left[i], i), va="center", fontsize="x-small")
    ax.set_yticks(range(len(ranks)), [f"rank {r}" + (" (slow)" if r in slow else "") for r in ranks])
    ax.set_ylim(len(ranks) - 0.5, -1.6)  # rank 0 on top, a free row above it for the legend
    ax.set_xlim(0, max(left) * 1.3 or 1)
    ax.legend(fontsize="x-small", loc="upper left", ncol=3, handlelength=1, columnspacing=0.8)
    if slow:
        ax.set_title(f"straggler: rank {', '.join(map(str, sorted(slow)))}; the others wait",
                     fontsize="small", color=TIME_COLORS["wait_s"])
    return med


def new_figure(n_axes=1, width=4.2, height=3.0, dpi=100):
    """A pyplot-free figure with `n_axes` side by side; returns (fig, [axes])."""
    fig = Figure(figsize=(width * n_axes, height), dpi=dpi, layout="constrained")
    axes = fig.subplots(1, n_axes, squeeze=False)[0]
    return fig, list(axes)


def present_metrics(rows, metrics):
    """The metrics of `metrics` that some row has; the first one if none has any yet."""
    have = [m for m in metrics if any(m in r for r in rows)]
    return have or list(metrics[:1])


def plot_run(run, metrics=("loss", "test_accuracy"), x="step", times=True):
    """Figure of one run: each metric per rank and the mean over ranks, and (times=True,
    when the rows have compute_s) where each rank's step time goes."""
    rec = _record(run)
    shown = present_metrics(rec.rows, metrics)
    bars = times and any("compute_s" in r for r in rec.rows)
    fig, axes = new_figure(len(shown) + bars)
    t0 = rec.config.get("start_unix") if x == "time" else None
    for ax, metric in zip(axes, shown):
        draw_metric(ax, rec.rows, metric, x=x, t0=t0)
    if bars:
        draw_step_times(axes[-1], rec.rows, rec.stragglers())
    fig.suptitle(f"{rec.name} ({rec.status}, {rec.config.get('nproc', '?')} process(es))")
    return fig


def compare_runs(run_dirs, metric="loss", labels=None, x="step", ranks=False):
    """Several runs on the same axes: the mean over ranks of `metric` for each."""
    recs = [_record(d) for d in run_dirs]
    labels = list(labels) if labels is not None else [r.name for r in recs]
    if len(labels) != len(recs):
        raise ValueError(f"{len(recs)} runs but {len(labels)} labels.")
    fig, (ax,) = new_figure(1, width=6.0, height=3.6)
    colors = [f"C{i % 10}" for i in range(len(recs))]
    for rec, name, color in zip(recs, labels, colors):
        t0 = rec.config.get("start_unix") if x == "time" else None
        per_rank, (mx, my) = series(rec.rows, metric, x=x, t0=t0)
        if ranks:
            for xs, ys in per_rank.values():
                ax.plot(xs, ys, lw=0.6, alpha=0.35, color=color)
        style = {"marker": "o", "markersize": 3} if len(mx) < 30 else {}
        ax.plot(mx, my, lw=1.8, color=color, label=f"{name} ({rec.status})" if rec.status != "ok" else name,
                **style)
    ax.set_xlabel(LABELS.get(x, x))
    ax.set_ylabel(LABELS.get(metric, metric) + " (mean over ranks)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def _run_seconds(rec, key):
    if key == "duration_s":
        return (rec.result or {}).get("duration_s")
    return rec.last(key)


def speedup_bars(runs, baseline=0, labels=None, key="duration_s", title=None):
    """Bar chart of speed-up over a baseline run.

    runs: a list of run directories (or RunRecords), or {label: seconds}. key: what to
    compare for run directories, "duration_s" (wall time, lower is better) or a throughput
    metric such as "samples_per_s" (higher is better). baseline: index or label of the run
    the others are measured against. For run directories the ideal speed-up (processes
    over the baseline's processes) is drawn as a dashed mark."""
    ideal = None
    if isinstance(runs, dict):
        names, values, higher_better = list(runs), [float(v) for v in runs.values()], False
    else:
        recs = [_record(r) for r in runs]
        names = list(labels) if labels is not None else [r.name for r in recs]
        values = [_run_seconds(r, key) for r in recs]
        higher_better = key != "duration_s"
        nprocs = [r.config.get("world_size") or r.config.get("nproc") for r in recs]
        if all(nprocs):
            ideal = nprocs
    if labels is not None and isinstance(runs, dict):
        names = list(labels)
    base = names.index(baseline) if isinstance(baseline, str) else int(baseline)
    if any(v is None or v <= 0 for v in values):
        missing = [n for n, v in zip(names, values) if v is None or v <= 0]
        raise ValueError(f"No usable {key} for: {', '.join(map(str, missing))}.")
    ratio = [(v / values[base]) if higher_better else (values[base] / v) for v in values]
    fig, (ax,) = new_figure(1, width=max(4.0, 1.3 * len(names) + 2), height=3.4)
    bars = ax.bar(range(len(names)), ratio, color=[f"C{i % 10}" for i in range(len(names))])
    unit = "s" if not higher_better else key.replace("_per_s", "/s").replace("_", " ")
    for bar, r, v in zip(bars, ratio, values):
        ax.annotate(f"{r:.2f}x\n({v:.3g} {unit})", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize="small")
    if ideal:
        for i, n in enumerate(ideal):
            ax.hlines(n / ideal[base], i - 0.4, i + 0.4, colors="gray", linestyles="dashed",
                      label="ideal (linear)" if i == 0 else None)
        ax.legend(fontsize="small", loc="upper left")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(names)), [str(n) for n in names])
    ax.set_ylabel(f"speed-up over {names[base]}")
    ax.set_ylim(0, max(ratio + [n / ideal[base] for n in ideal] if ideal else ratio) * 1.25)
    if title:
        ax.set_title(title)
    return fig


class LivePlot:
    """The run panel's figure. One Figure is kept across frames and drawn with draw_metric
    (which then only swaps line data); it has a fixed layout, because a layout engine
    costs more than the drawing itself, and renders to PNG with Agg, off any thread.
    The step-time bars draw the runs.StepTimes and the stragglers of a monitor.Monitor's
    Update: the monitor judges, the plot draws its verdict."""

    def __init__(self, metrics=("loss", "test_accuracy"), x="step", width=4.6, height=2.9, dpi=80):
        self.metrics, self.x = tuple(metrics), x
        self.size, self.dpi = (width, height), dpi
        self.reset()

    def reset(self, t0=None):
        """Forget the rows (a new run); t0 is the zero of a time axis."""
        self.series = {m: Series(m, x=self.x, t0=t0) for m in self.metrics}
        self.title = ""   # the figure's title, drawn by the next render()
        self.fig, self.axes, self._shown, self._drawn_title = None, [], None, None

    def add(self, rows):
        for s in self.series.values():
            s.add(rows)

    def points(self):
        return sum(len(s) for s in self.series.values())

    def render(self, title=None, times=None, stragglers=()):
        """PNG bytes of the current rows (under `title`, which becomes self.title), with
        step-time bars from `times` (a runs.StepTimes) when it has any, `stragglers` named."""
        if title is not None:
            self.title = title
        shown = [m for m in self.metrics if len(self.series[m])] or list(self.metrics[:1])
        if times is not None and times.per_rank:
            shown.append("step times")
        if shown != self._shown:
            w, h = self.size
            self.fig = Figure(figsize=(w * len(shown), h), dpi=self.dpi)
            self.fig.subplots_adjust(left=0.65 / (w * len(shown)), right=0.985, bottom=0.17,
                                     top=0.86, wspace=0.3)
            self.axes = list(self.fig.subplots(1, len(shown), squeeze=False)[0])
            self._shown, self._drawn_title = shown, None
        for ax, metric in zip(self.axes, shown):
            if metric == "step times":
                draw_step_times(ax, times, stragglers)
            else:
                draw_metric(ax, self.series[metric], metric, x=self.x)
        if self.title != self._drawn_title:
            # wrapped to the figure's width (about 12 characters an inch): a long title is not clipped
            width = max(30, int(12 * self.fig.get_figwidth()))
            self.fig.suptitle(textwrap.fill(self.title, width), fontsize="medium")
            self._drawn_title = self.title
        buf = io.BytesIO()
        FigureCanvasAgg(self.fig).print_png(buf)
        return buf.getvalue()


def to_png(fig, dpi=None):
    """PNG bytes of a figure (Agg), without pyplot."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()

