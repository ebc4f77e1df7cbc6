"""Notebook 05's exercise: where no_sync() goes, predicted against what a run measured
(check_no_sync; all_reduced and weights_equal read the measurement)."""
from .common import finished


def all_reduced(run_dir):
    """05: {placement: [rank][micro-batch] -> did its forward and backward all-reduce?}, from
    the rows ex_no_sync.py logged."""
    rec, world = finished(run_dir)
    out = {}
    rows = (r for r in rec.rows if "placement" in r and "all_reduces" in r)
    for row in sorted(rows, key=lambda r: (r["rank"], r["step"])):
        ranks = out.setdefault(row["placement"], [[] for _ in range(world)])
        ranks[row["rank"]].append(row["all_reduces"] > 0)
    return out


def weights_equal(run_dir, tol=1e-7):
    """05: {placement: do the ranks' weights agree after its optimizer step?}, from the
    spread ex_no_sync.py logged."""
    rec, _ = finished(run_dir)
    return {r["placement"]: r["weights_spread"] <= tol for r in rec.rows if "weights_spread" in r}


def check_no_sync(run_dir, predicted, equal=None):
    """05: `predicted` maps each placement of no_sync() to the micro-batches (numbered from 1)
    whose forward and backward all-reduce; `equal` maps it to whether the ranks' weights agree
    after the window's optimizer step. Both compared with what the run measured on every rank.
    A wrong answer is not named: the verdict says only that one differs, so guessing one
    placement at a time does not pay."""
    measured = all_reduced(run_dir)
    agree = weights_equal(run_dir)
    assert measured, "the run logged no micro-batches"
    world = len(next(iter(measured.values())))
    wrong = 0
    for placement, ranks in measured.items():
        synced = [[k + 1 for k, on in enumerate(row) if on] for row in ranks]
        assert all(s == synced[0] for s in synced), f"{placement}: the ranks all-reduced at different micro-batches {synced}"
        guess = predicted.get(placement)
        assert guess is not None, f"no prediction yet for {placement!r}"
        assert isinstance(guess, (list, tuple, set)) and all(isinstance(k, int) for k in guess), \
            f"{placement}: say the micro-batches as a list of numbers, such as [1, 2], not {guess!r}"
        said = (equal or {}).get(placement)
        assert isinstance(said, bool), f"no True or False yet for the weights of {placement!r}"
        wrong += sorted(guess) != synced[0]
        if world > 1:        # one rank: its weights cannot differ from another's, nothing to predict
            assert placement in agree, f"the run logged no weights for {placement!r}"
            wrong += said != agree[placement]
    assert not wrong, ("at least one answer differs from what the run measured; the checker does not say "
                       "which. Go through each placement and micro-batch: where did its forward run? Then: "
                       "did every rank end the window with the same gradient?")
    return f"all {len(measured)} placements as the run measured them on {world} rank(s)" + (
        "; at one rank the weights cannot differ, so they were not graded" if world == 1 else "")
