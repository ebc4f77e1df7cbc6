"""The batch pictures (notebooks 04 and 05) draw what their data says: each test reads the
figure back (texts, lines, dots, patches) and compares it with the input, and a planted wrong
input must fail that comparison."""
import re

import pytest
import torch

from ddp_lesson import diagrams


def _by_gid(fig, prefix):
    ax = fig.axes[0]
    items = list(ax.lines) + list(ax.collections) + list(ax.patches) + list(ax.texts)
    return {a.get_gid(): a for a in items if (a.get_gid() or "").startswith(prefix)}


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


def read_bn(fig):
    """(values, rank_stats, sync_stats) as the figure draws them."""
    labels = _by_gid(fig, "label:")
    keys = sorted((k.split(":")[1] for k in labels if k != "label:sync"), key=lambda k: int(k[4:]))

    def stats(key):
        m = re.search(r"mean (-?[\d.]+), var ([\d.]+)  \((\d+) values\)", labels[f"label:{key}"].get_text())
        tick = _by_gid(fig, f"mean:{key}")[f"mean:{key}"].get_xdata()
        bar = _by_gid(fig, f"std:{key}")[f"std:{key}"].get_xdata()
        mean, var = float(m.group(1)), float(m.group(2))
        assert tick[0] == tick[1] and (bar[1] - bar[0]) / 2 == pytest.approx(var ** 0.5, abs=2e-3)
        assert tick[0] == pytest.approx(mean, abs=1e-3)
        dots = _by_gid(fig, f"values:{key}")[f"values:{key}"].get_offsets()[:, 0].tolist()
        assert len(dots) == int(m.group(3))
        return dots, (tick[0], (bar[1] - bar[0]) ** 2 / 4)

    ranks = [stats(k) for k in keys]
    pooled, sync = stats("sync")
    line = _by_gid(fig, "sync-mean-line")["sync-mean-line"].get_xdata()
    assert line[0] == pytest.approx(sync[0])
    assert pooled == [v for dots, _ in ranks for v in dots]     # the last row: every rank's values
    return [d for d, _ in ranks], [s for _, s in ranks], sync


def same_bn(drawn, given):
    values, rank_stats, sync = drawn
    want_values, want_stats, want_sync = given
    if len(values) != len(want_values):
        return False
    ok = all(a == pytest.approx(b, abs=1e-6) for a, b in zip(values, want_values))
    ok &= all(a == pytest.approx(b, rel=1e-4, abs=1e-5) for a, b in zip(rank_stats, want_stats))
    return ok and sync == pytest.approx(want_sync, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_bn_statistics_draws_each_rank_and_the_global_statistics(world):
    given = bn_input(world)
    fig = diagrams.bn_statistics(*given)
    assert same_bn(read_bn(fig), given)
    assert len(fig.axes) == 1 and len(fig.axes[0].texts) == world + 1


def test_bn_statistics_read_back_catches_a_planted_wrong_input():
    values, rank_stats, sync = bn_input(3)
    drawn = read_bn(diagrams.bn_statistics(values, rank_stats, sync))
    planted = [
        (values, rank_stats[::-1], sync),                       # ranks' statistics swapped
        (values, rank_stats, (sync[0] + 0.01, sync[1])),        # a global mean that is off
        (values, rank_stats, (rank_stats[0][0], rank_stats[0][1])),   # rank 0's stats as global
        (values[:2], rank_stats[:2], sync),                     # a rank left out
        ([v[:-1] for v in values], rank_stats, sync),           # a value left out
    ]
    for wrong in planted:
        assert not same_bn(drawn, wrong)
    assert same_bn(drawn, (values, rank_stats, sync))


def test_bn_statistics_global_row_is_every_rank_pooled():
    values, rank_stats, sync = bn_input(2)
    pooled = [v for vs in values for v in vs]
    mean = sum(pooled) / len(pooled)
    var = sum((v - mean) ** 2 for v in pooled) / len(pooled)
    assert sync == pytest.approx((mean, var), rel=1e-4)     # the input: BN over the whole batch
    drawn = read_bn(diagrams.bn_statistics(values, rank_stats, sync))
    assert drawn[2] == pytest.approx((mean, var), rel=1e-4, abs=1e-5)


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


def read_windows(fig):
    """(window sizes, divisors, per-rank all-reduced flags) as the figure draws them."""
    bands = _by_gid(fig, "window:")
    labels = _by_gid(fig, "window-label:")
    sizes, divisors = [], []
    for step in sorted(int(k.split(":")[1]) for k in bands):
        rect = bands[f"window:{step}"]
        sizes.append(round(rect.get_width() + 0.1))
        m = re.search(r"optimizer step (\d+)\nloss \u00f7 (\d+)", labels[f"window-label:{step}"].get_text())
        assert int(m.group(1)) == step
        divisors.append(int(m.group(2)))
    cells = _by_gid(fig, "micro:")
    world = 1 + max(int(k.split(":")[1]) for k in cells)
    n = max(int(k.split(":")[2]) for k in cells)
    synced = [[f"micro:{r}:{i}:AR" in cells for i in range(1, n + 1)] for r in range(world)]
    assert len(cells) == world * n
    return sizes, divisors, synced


def from_rows(rows):
    sizes, divisors = [], []
    for row in rows[0]:
        if not sizes or row["step"] != len(sizes):
            sizes.append(0)
            divisors.append(row["window"])
        sizes[-1] += 1
    return sizes, divisors, [[r["all_reduces"] > 0 for r in rank] for rank in rows]


@pytest.mark.parametrize("n,k,world,want", [(10, 4, 2, [4, 4, 2]), (10, 4, 3, [4, 4, 2]),
                                            (8, 4, 1, [4, 4]), (7, 3, 2, [3, 3, 1]), (5, 1, 2, [1] * 5)])
def test_accumulation_windows_draws_the_logged_windows(n, k, world, want):
    rows = loop_rows(n, k, world)
    drawn = read_windows(diagrams.accumulation_windows(rows))
    assert drawn == from_rows(rows)
    assert drawn[0] == want and drawn[1] == want       # each window's loss divided by its own size
    assert all(s == [i in {sum(want[:j + 1]) for j in range(len(want))} for i in range(1, n + 1)]
               for s in drawn[2])                      # AR on the last micro-batch of each window


def test_accumulation_windows_read_back_catches_a_planted_wrong_input():
    rows = loop_rows(10, 4, 2)
    drawn = read_windows(diagrams.accumulation_windows(rows))
    assert drawn == from_rows(rows)
    planted = [
        loop_rows(10, 4, 2, ar_at_last=False),        # no_sync turned around
        loop_rows(10, 5, 2),                          # windows (5, 5)
        loop_rows(10, 4, 3),                          # a rank too many
        [[dict(r, window=4) for r in rank] for rank in rows],   # the short window divided by k
    ]
    drifted = [list(rank) for rank in rows]
    drifted[1] = [dict(r, all_reduces=0) for r in drifted[1]]   # rank 1 never all-reduced
    planted.append(drifted)
    for wrong in planted:
        assert drawn != from_rows(wrong)
