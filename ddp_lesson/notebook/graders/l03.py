"""Notebook 03's exercise: a sampler that shuffles anew every epoch, the same on every rank
(graded on a finished run directory: launch it with common.attempt)."""
from collections import defaultdict

from .common import finished


def check_set_epoch(run_dir):
    """03: every epoch a new order, the same shuffle on every rank: disjoint shards that
    together cover all the data set's samples once per epoch. Every pair of epochs differs, not
    only neighbours: each rank's order and set of samples, and the split into shards, so a fixed
    shuffle whose shards rotate over the ranks is rejected."""
    rec, world = finished(run_dir)
    order = defaultdict(list)                    # (rank, epoch) -> indices in training order
    sizes = {row["samples"] for row in rec.rows if "samples" in row}
    assert len(sizes) == 1, "the run did not log its data set's size (samples) once, the same on every rank"
    n = sizes.pop()
    for row in rec.rows:
        if "indices" in row:
            order[row["rank"], row["epoch"]].extend(row["indices"])
    epochs = sorted({e for _, e in order})
    assert len(epochs) >= 2, "the run logged fewer than 2 epochs of indices"
    for e in epochs:
        shards = [order[r, e] for r in range(world)]
        everything = sorted(i for s in shards for i in s)
        assert everything == sorted(set(everything)), \
            f"epoch {e}: some sample was trained on by two ranks (do all ranks draw the same permutation: the same seed on every rank?)"
        assert everything == list(range(n)), \
            f"epoch {e}: the shards cover {len(set(everything) & set(range(n)))} of the {n} samples"
    for i, a in enumerate(epochs):               # every pair of epochs, not only neighbours
        for b in epochs[i + 1:]:
            for r in range(world):
                assert order[r, a] != order[r, b], \
                    f"rank {r} saw the same samples in the same order in epochs {a} and {b}"
                assert world == 1 or set(order[r, a]) != set(order[r, b]), \
                    f"rank {r} trained on the same samples in epochs {a} and {b}, only reordered: " \
                    "shuffle all n indices, then give each rank its share"
            shards_a = sorted(sorted(order[r, a]) for r in range(world))
            assert world == 1 or shards_a != sorted(sorted(order[r, b]) for r in range(world)), \
                f"epochs {a} and {b} split the samples into the same shards, only handed to other ranks: " \
                "draw a new permutation every epoch, from seed + epoch"
    return f"{world} rank(s), {len(epochs)} epochs, each epoch a new order"
