"""The batch pictures (notebooks 04 and 05) draw what their data says. Each test reads the
figure back: where every dot, tick, bar, cell and band sits, its colour and its text, and
compares them with the input. A planted wrong input must fail that comparison, and so must each
planted drawing bug: a mutated copy of diagrams/batches.py."""
import re
import types
from pathlib import Path

import pytest
import torch
from matplotlib.colors import to_hex

from ddp_lesson.notebook import diagrams
from ddp_lesson.notebook.diagrams import batches, shapes
from ddp_lesson.notebook.diagrams.shapes import DEVICE_COLOURS

AR_RED, NO_SYNC_GREY = "#c44e52", "#808080"


def _by_gid(fig, prefix):
    ax = fig.axes[0]
    items = list(ax.lines) + list(ax.collections) + list(ax.patches) + list(ax.texts)
    return {a.get_gid(): a for a in items if (a.get_gid() or "").startswith(prefix)}


def _one(fig, gid):
    found = _by_gid(fig, gid)
    assert gid in found, f"nothing drawn with gid {gid}"
    return found[gid]


def _hex(colour):
    return to_hex(colour, keep_alpha=False)


# --- per-rank vs global BatchNorm statistics ---------------------------------------------------

def bn_input(world=3, b=4, seed=0):
    """Real BN statistics: one channel of a BatchNorm2d's input, b samples per rank."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world * b, 2, 4, 4, generator=g) * torch.linspace(0.5, 3, world * b).view(-1, 1, 1, 1)
    values = [x[r * b:(r + 1) * b, 0].reshape(-1).tolist() for r in range(world)]
    rank_stats = []
    for r in range(world):
        bn = torch.nn.BatchNorm2d(2, momentum=1.0)    # momentum 1: running stats = this batch's
        bn(x[r * b:(r + 1) * b])
        n = b * 16
        rank_stats.append((bn.running_mean[0].item(), bn.running_var[0].item() * (n - 1) / n))
    whole = torch.nn.BatchNorm2d(2, momentum=1.0)
    whole(x)                                           # what SyncBN computes: the whole batch
    n = world * b * 16
    return values, rank_stats, (whole.running_mean[0].item(), whole.running_var[0].item() * (n - 1) / n)


def check_bn(fig, given):
    """Assert that the figure draws `given` = (values, rank_stats, sync_stats): one row per rank
    from the top, rank 0 first, then the SyncBN row; each row's dots at its values and near its
    own height, its tick at its mean, its bar over mean +- std, its label naming it, all in its
    rank's colour (the SyncBN row in the global colour); the dashed line at SyncBN's mean."""
    values, rank_stats, sync = given
    ranks = len(values)
    assert len(fig.axes) == 1 and len(fig.axes[0].texts) == ranks + 1
    rows = [(f"rank {r}", values[r], rank_stats[r], f"rank{r}", DEVICE_COLOURS[r % len(DEVICE_COLOURS)])
            for r in range(ranks)]
    rows.append(("SyncBN, all ranks", [v for vs in values for v in vs], sync, "sync", batches.GLOBAL_COLOUR))
    for k, (name, vs, (mean, var), key, colour) in enumerate(rows):
        y, std = ranks - k, var ** 0.5
        label, tick = _one(fig, f"label:{key}"), _one(fig, f"mean:{key}")
        bar, dots = _one(fig, f"std:{key}"), _one(fig, f"values:{key}")
        head, stats = label.get_text().split("\n")
        assert head == name and label.get_position()[1] == pytest.approx(y)
        m = re.fullmatch(r"mean (-?[\d.]+), var ([\d.]+)  \((\d+) values\)", stats)
        assert float(m.group(1)) == pytest.approx(mean, abs=1e-3)
        assert float(m.group(2)) == pytest.approx(var, abs=1e-3) and int(m.group(3)) == len(vs)
        assert list(tick.get_xdata()) == pytest.approx([mean, mean], rel=1e-4, abs=1e-5)
        assert list(tick.get_ydata()) == pytest.approx([y - 0.3, y + 0.3])
        assert list(bar.get_xdata()) == pytest.approx([mean - std, mean + std], rel=1e-4, abs=1e-5)
        assert list(bar.get_ydata()) == pytest.approx([y, y])
        xy = dots.get_offsets()
        assert xy[:, 0].tolist() == pytest.approx(list(vs), abs=1e-6)
        assert all(abs(v - y) <= 0.15 for v in xy[:, 1])          # near its own row only
        drawn = {_hex(tick.get_color()), _hex(bar.get_color()), _hex(label.get_color()),
                 _hex(dots.get_facecolor()[0])}
        assert drawn == {_hex(colour)}, (name, drawn)
    assert len({_hex(c) for *_, c in rows}) == min(ranks, len(DEVICE_COLOURS)) + 1   # ranks apart, SyncBN apart
    assert list(_one(fig, "sync-mean-line").get_xdata()) == pytest.approx([sync[0]] * 2)


def bn_fails(fig, given):
    try:
        check_bn(fig, given)
    except AssertionError:
        return True
    return False


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_bn_statistics_draws_each_rank_and_the_global_statistics(world):
    given = bn_input(world)
    check_bn(diagrams.bn_statistics(*given), given)


def test_bn_statistics_read_back_catches_a_planted_wrong_input():
    values, rank_stats, sync = bn_input(3)
    fig = diagrams.bn_statistics(values, rank_stats, sync)
    planted = [
        (values, rank_stats[::-1], sync),                       # ranks' statistics swapped
        (values, rank_stats, (sync[0] + 0.01, sync[1])),        # a global mean that is off
        (values, rank_stats, (rank_stats[0][0], rank_stats[0][1])),   # rank 0's stats as global
        (values[:2], rank_stats[:2], sync),                     # a rank left out
        ([v[:-1] for v in values], rank_stats, sync),           # a value left out
        (values[::-1], rank_stats[::-1], sync),                 # ranks in the wrong rows
    ]
    for wrong in planted:
        assert bn_fails(fig, wrong)
    check_bn(fig, (values, rank_stats, sync))


def test_bn_statistics_global_row_is_every_rank_pooled():
    values, rank_stats, sync = bn_input(2)
    pooled = [v for vs in values for v in vs]
    mean = sum(pooled) / len(pooled)
    var = sum((v - mean) ** 2 for v in pooled) / len(pooled)
    assert sync == pytest.approx((mean, var), rel=1e-4)     # the input: BN over the whole batch
    check_bn(diagrams.bn_statistics(values, rank_stats, sync), (values, rank_stats, (mean, var)))


# --- accumulation windows ---------------------------------------------------------------------

def loop_rows(n, k, world=2, ar_at_last=True):
    """The rows ddp_accum.py's loop would log: its own `window` and `last` lines."""
    rows, step = [], 1
    for i in range(n):
        window = min(k, n - (i - i % k))
        last = (i + 1) % k == 0 or i + 1 == n
        rows.append({"micro_batch": i + 1, "step": step, "window": window,
                     "all_reduces": int(last == ar_at_last)})
        step += last
    return [list(rows) for _ in range(world)]


def check_windows(fig, rows):
    """Assert that the figure draws `rows`: one row of cells per rank from the top, rank 0
    first and labelled so; each micro-batch's cell in its own column under its number, red
    with "AR" where it all-reduced, grey and empty where it did not; one band per optimizer
    step over exactly its micro-batches, labelled with the step and the window it divides by."""
    ax = fig.axes[0]
    ranks, n = len(rows), len(rows[0])
    xticks = dict(zip((t.get_text() for t in ax.get_xticklabels()), ax.get_xticks()))
    yticks = dict(zip((t.get_text() for t in ax.get_yticklabels()), ax.get_yticks()))
    assert sorted(xticks, key=int) == [str(i) for i in range(1, n + 1)]
    cells = {}
    for rank, rank_rows in enumerate(rows):
        y = ranks - 1 - rank                                    # rank 0 on top
        assert yticks[f"rank {rank}"] == pytest.approx(y + 0.35)
        for row in rank_rows:
            cell = f"{rank}:{row['micro_batch']}"
            fill, text = _one(fig, f"micro-fill:{cell}"), _one(fig, f"micro-text:{cell}")
            x0, y0 = fill.get_x(), fill.get_y()
            assert x0 + fill.get_width() / 2 == pytest.approx(xticks[str(row["micro_batch"])])
            assert y0 < yticks[f"rank {rank}"] < y0 + fill.get_height()
            on = row["all_reduces"] > 0
            assert _hex(fill.get_facecolor()) == (AR_RED if on else NO_SYNC_GREY), cell
            assert text.get_text() == ("AR" if on else ""), cell
            tx, ty = text.get_position()
            assert x0 < tx < x0 + fill.get_width() and y0 < ty < y0 + fill.get_height()
            cells[cell] = (x0, x0 + fill.get_width(), y0, y0 + fill.get_height())
    assert len(_by_gid(fig, "micro-fill:")) == ranks * n
    steps = {}
    for row in rows[0]:
        steps.setdefault(row["step"], []).append(row)
    bands = _by_gid(fig, "window:")
    assert sorted(bands) == sorted(f"window:{s}" for s in steps)
    for step, members in steps.items():
        band, label = bands[f"window:{step}"], _one(fig, f"window-label:{step}")
        lo, hi = band.get_x(), band.get_x() + band.get_width()
        inside = {row["micro_batch"] for row in members}
        for cell, (x0, x1, y0, y1) in cells.items():
            mb = int(cell.split(":")[1])
            covered = lo <= x0 and x1 <= hi + 0.2 and band.get_y() <= y0 and y1 <= band.get_y() + band.get_height()
            assert covered == (mb in inside), (step, cell)
        assert label.get_text() == f"optimizer step {step}\nloss \u00f7 {members[0]['window']}"
        assert lo < label.get_position()[0] < hi


def windows_fail(fig, rows):
    try:
        check_windows(fig, rows)
    except AssertionError:
        return True
    return False


@pytest.mark.parametrize("n,k,world,want", [(10, 4, 2, [4, 4, 2]), (10, 4, 3, [4, 4, 2]),
                                            (8, 4, 1, [4, 4]), (7, 3, 2, [3, 3, 1]), (5, 1, 2, [1] * 5)])
def test_accumulation_windows_draws_the_logged_windows(n, k, world, want):
    rows = loop_rows(n, k, world)
    assert [sum(r["step"] == s for r in rows[0]) for s in range(1, len(want) + 1)] == want
    check_windows(diagrams.accumulation_windows(rows), rows)


def test_accumulation_windows_read_back_catches_a_planted_wrong_input():
    rows = loop_rows(10, 4, 2)
    fig = diagrams.accumulation_windows(rows)
    check_windows(fig, rows)
    drifted = [list(rank) for rank in rows]
    drifted[1] = [dict(r, all_reduces=0) for r in drifted[1]]   # rank 1 never all-reduced
    planted = [
        loop_rows(10, 4, 2, ar_at_last=False),        # no_sync turned around
        loop_rows(10, 5, 2),                          # windows (5, 5)
        loop_rows(10, 4, 3),                          # a rank too many
        [[dict(r, window=4) for r in rank] for rank in rows],   # the short window divided by k
        drifted,
    ]
    for wrong in planted:
        assert windows_fail(fig, wrong)


# --- planted drawing bugs: a mutated copy of batches.py must fail the read-back ---------------

DRAWING_BUGS = {   # name -> (text in batches.py, its wrong replacement)
    "bn: every row at y = 0": ("y = ranks - k ", "y = 0 "),
    "bn: every label says rank 0": ('ax.text(1.01, y, f"{name}\\n', 'ax.text(1.01, y, f"rank 0\\n'),
    "bn: ranks in the global colour": ("DEVICE_COLOURS[r % len(DEVICE_COLOURS)], f\"rank{r}\"",
                                       "GLOBAL_COLOUR, f\"rank{r}\""),
    "bn: dots on another row": ("_jitter(len(vs), y)", "_jitter(len(vs), 0)"),
    "windows: every cell red": ('"#C44E52" if on else "grey"', '"#C44E52"'),
    "windows: every cell says AR": ('"AR" if on else ""', '"AR"'),
    "windows: every cell at x = 0": ('x = row["micro_batch"] - 1', "x = 0"),
    "windows: every rank on one row": ("y = ranks - 1 - rank", "y = 0"),
    "windows: every band at x = 0": ("Rectangle((start - 0.05,", "Rectangle((-0.05,"),
    "windows: steps numbered from 0": ('f"optimizer step {step}', 'f"optimizer step {step - 1}'),
}


# the grid's frame is drawn by shapes.rank_grid, which batches.py imports: planted there
FRAME_BUGS = {
    "windows: rank labels reversed": ('[f"rank {r}" for r in range(ranks)]',
                                      '[f"rank {r}" for r in reversed(range(ranks))]'),
    "windows: micro-batch numbers shifted": ("[str(k + 1) for k in range(columns)]",
                                             "[str(k + 2) for k in range(columns)]"),
}


def mutated(real, old=None, new=None):
    """A copy of the module `real`, with `old` (found exactly once in its source) replaced by `new`."""
    source = Path(real.__file__).read_text()
    if old is not None:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    module = types.ModuleType(real.__name__ + "_planted")
    module.__package__ = "ddp_lesson.notebook.diagrams"
    exec(compile(source, Path(real.__file__).stem + "_planted.py", "exec"), module.__dict__)
    return module


def planted_module(old, new, where=batches):
    """batches.py with a drawing bug planted in it, or in shapes.py (where=shapes): then the
    copy of batches uses the planted copy of every name it imports from shapes."""
    if where is batches:
        return mutated(batches, old, new)
    module, planted = mutated(batches), mutated(shapes, old, new)
    for name, value in vars(shapes).items():
        if module.__dict__.get(name) is value:
            module.__dict__[name] = getattr(planted, name)
    return module


@pytest.mark.parametrize("name", list(DRAWING_BUGS) + list(FRAME_BUGS))
def test_each_planted_drawing_bug_fails_the_read_back(name):
    module = planted_module(*DRAWING_BUGS[name]) if name in DRAWING_BUGS else planted_module(*FRAME_BUGS[name], where=shapes)
    if name.startswith("bn:"):
        given = bn_input(3)
        assert bn_fails(module.bn_statistics(*given), given)
    else:
        rows = loop_rows(10, 4, 3)
        assert windows_fail(module.accumulation_windows(rows), rows)


def test_the_unmutated_copy_passes():
    module = planted_module("GLOBAL_COLOUR = ", "GLOBAL_COLOUR = ")
    given, rows = bn_input(3), loop_rows(10, 4, 3)
    check_bn(module.bn_statistics(*given), given)
    check_windows(module.accumulation_windows(rows), rows)
