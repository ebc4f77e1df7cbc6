"""Notebook 04's exercises: every rank's global BatchNorm statistics (launched: check_global_bn on
a finished run directory) and merging per-rank statistics (check_merge, a function)."""
from .common import finished


def check_global_bn(run_dir, tol=1e-6):
    """04: every rank holds, per channel, the mean and the biased variance of every rank's x
    together (the global batch, as SyncBatchNorm's forward needs them), from the x each rank
    logged. The ranks hold different numbers of samples, so an unweighted average of their
    means is wrong, and an average of their variances leaves out the spread between means.
    Within `tol`: the mean in standard deviations, the variance relative. A float32 answer is
    off by about 1e-7; the unbiased variance by 1/(n - 1), under 1e-4 at 7 or more ranks.
    Each rank's x carries a shift only that rank knows, so an answer that rebuilds the other
    ranks' x without communicating fails too (off by their shifts)."""
    import torch
    rec, world = finished(run_dir)
    assert world > 1, "with one rank its batch is the global batch: run it on 2 or more"
    xs = {row["rank"]: torch.tensor(row["x"], dtype=torch.float64) for row in rec.rows if "x" in row}
    got = {row["rank"]: row for row in rec.rows if "var" in row}
    assert sorted(xs) == sorted(got) == list(range(world)), \
        "not every rank logged its x and then its mean and var"
    dims = (0, 2, 3)
    whole = torch.cat([xs[r] for r in range(world)])
    want_mean, want_var = whole.mean(dims), whole.var(dims, unbiased=False)
    own = {r: (xs[r].mean(dims), xs[r].var(dims, unbiased=False)) for r in range(world)}
    avg_mean = sum(m for m, _ in own.values()) / world
    avg_var = sum(v for _, v in own.values()) / world
    scale = want_var.sqrt()
    gap = max(((avg_var - want_var).abs() / want_var).max().item(),
              ((avg_mean - want_mean).abs() / scale).max().item())
    # else an average of the ranks' statistics would pass: this run could not tell them apart
    assert gap > 1e-3, f"the ranks' batches are too alike to tell a wrong merge from the right one ({gap:.2g})"
    off_mean = lambda a, b: ((a - b).abs() / scale).max().item()      # in standard deviations
    off_var = lambda a, b: ((a - b).abs() / want_var).max().item()    # relative
    wrong_vars = {  # the common wrong variances, with the right mean, to name the one a learner gave
        "the average of the ranks' variances, which leaves out how far each rank's mean is from "
        "the global mean": avg_var,
        "the unbiased variance (n - 1): divide by the count n, not n - 1, as BatchNorm "
        "normalises with": whole.var(dims, unbiased=True),
    }
    for r in reversed(range(world)):          # the last first: a copy of rank 0's is named as such
        mean = torch.tensor(got[r]["mean"], dtype=torch.float64)
        var = torch.tensor(got[r]["var"], dtype=torch.float64)
        assert mean.shape == want_mean.shape and var.shape == want_var.shape, \
            f"rank {r}: mean and var should each hold {len(want_mean)} numbers, one per channel"
        mean_off, var_off = off_mean(mean, want_mean), off_var(var, want_var)
        if mean_off < tol and var_off < tol:
            continue
        if off_mean(mean, own[r][0]) < tol and off_var(var, own[r][1]) < tol:
            raise AssertionError(f"rank {r} still holds this rank's own statistics")
        if mean_off >= tol:
            close = off_mean(mean, avg_mean) < tol
            raise AssertionError(f"rank {r}: the mean is off by up to {mean_off:.2g} standard deviations"
                                 + (": that is the unweighted average of the ranks' means, but rank r holds "
                                    "3 + r images" if close else ""))
        named = next((name for name, v in wrong_vars.items() if off_var(var, v) < tol), None)
        raise AssertionError(f"rank {r}: the mean is right, the variance is off by up to {var_off:.2g} "
                             "of the right value" + (f": that is {named}" if named else ""))
    return f"every one of {world} ranks holds the global batch's {len(want_mean)} means and variances"


def check_merge(fn):
    """04: fn([(n_r, mean_r, var_r), ...]) -> (mean, var) of the concatenated batch, also for
    data far from 0 next to its spread (around 1e8)."""
    import torch
    g = torch.Generator().manual_seed(0)
    for offset in (0.0, 1e8):                 # data around 0, and far from 0 next to its spread
        chunks = [torch.randn(n, generator=g, dtype=torch.float64) * s + m + offset
                  for n, s, m in ((4, 1.0, 0.0), (4, 2.0, 3.0), (7, 0.5, -1.0))]
        parts = [(len(c), c.mean().item(), c.var(unbiased=False).item()) for c in chunks]
        whole = torch.cat(chunks)             # the concatenated batch
        mean, var = fn(parts)
        want_mean, want_var = whole.mean().item(), whole.var(unbiased=False).item()
        assert abs(mean - want_mean) <= 1e-9 * max(1.0, abs(want_mean)), \
            f"data around {offset:g}: the mean is off by {mean - want_mean:.3g}"
        assert abs(var - want_var) < 1e-6 * want_var, \
            f"data around {offset:g}: the variance is off by {var - want_var:.3g} (of {want_var:.3g})"
    return True
