"""Lesson 09: the alpha-beta model, t = alpha + bytes / beta, asked to predict all-reduce
workloads it was not fitted to.

fit_and_held_out (on every rank) times costmodel's sweep and the held-out workloads,
interleaved, with more rounds while load blurs them; held_out_ratios fits the line and
divides measured by predicted; check_held_out names the workloads the model misses by more
than a factor; check_per_call compares 64 small all-reduces with one, timed in the same rounds, so load slows both about alike.
"""
import time

import torch
import torch.distributed as dist

from ddp_lesson.rank import costmodel


def allreduce_seconds(sizes, reps=3, device=None):
    """Seconds for all-reduces of tensors of these byte sizes, back to back (slowest rank)."""
    flats = [torch.zeros(max(1, b // 4), device=device) for b in sizes]
    for f in flats:
        dist.all_reduce(f)                                # warm-up
    dist.barrier()
    t = time.perf_counter()
    for _ in range(reps):
        for f in flats:
            dist.all_reduce(f)
    seconds = torch.tensor([(time.perf_counter() - t) / reps], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def fit_and_held_out(held, rounds=5, device=None, factor=3.0, max_rounds=15):
    """Sweep (costmodel.QUICK_SIZES) and every held-out workload, interleaved, `rounds` rounds
    at a time; each keeps its fastest round. Load only adds time, so more rounds bring both
    sides nearer the machine's own cost: while the model misses a workload by more than
    `factor`, `rounds` more are run, up to `max_rounds`. A wrong model stays wrong.
    Every rank gets the slowest rank's times, so every rank decides alike.
    Returns (rows for costmodel.fit, {name: (sizes, seconds)})."""
    sweeps, seconds = [], {name: [] for name in held}
    while True:
        for _ in range(rounds):
            sweeps.append(costmodel.sweep(costmodel.QUICK_SIZES, iters=4, device=device))
            for name, sizes in held.items():
                seconds[name].append(allreduce_seconds(sizes, device=device))
        rows = [{"bytes": b, "seconds": min(s[i][1] for s in sweeps)} for i, (b, _) in enumerate(sweeps[0])]
        out = {name: (held[name], min(v)) for name, v in seconds.items()}
        if len(sweeps) >= max_rounds or not check_held_out(held_out_ratios(rows, out), factor):
            return rows, out


def predict_seconds(sizes, alpha, beta):
    """The model: every all-reduce pays the latency once, plus its bytes at the bandwidth."""
    return sum(alpha + b / beta for b in sizes)


def held_out_ratios(rows, held, predict=predict_seconds):
    """Fit alpha and beta to `rows`, then measured / predicted for each held-out workload."""
    alpha, beta = costmodel.fit(rows)
    return {name: seconds / predict(sizes, alpha, beta) for name, (sizes, seconds) in held.items()}


def band(world, cores, load):
    """(factor, reason): how far measured / predicted may stray. 3 while the ranks have the
    cores to themselves. With more ranks than cores, or other programs keeping half the cores
    busy (the load average less the ranks' own share), a ring's every hop can wait a scheduler
    time slice, milliseconds, for a rank the OS has put aside, whatever the bytes: 20 then.
    20 still fails a line without alpha (thousands of times off). It can let alpha paid once
    for 64 all-reduces through (at 4 ranks on 2 cores that scored about 19), which
    check_per_call catches it at any load that slows both sides about alike, and a bytes formula off by 4."""
    others = max(0.0, load - world)
    if world > cores:
        return 20.0, f"{world} ranks share {cores} cores, so they wait for each other's time slices"
    if others > cores / 2:
        return 20.0, (f"load average {load:.1f} on {cores} cores, about {others:.1f} of it from other "
                      f"programs, so the ranks wait for time slices")
    return 3.0, f"{world} rank(s) on {cores} cores, load average {load:.1f}: the ranks have the cores"


def check_held_out(ratios, factor=3.0):
    """The workloads the model misses by more than `factor`, either way ([] if none)."""
    return [f"{name}: measured / predicted = {r:.2f}" for name, r in ratios.items()
            if not 1 / factor <= r <= factor]


def check_per_call(ratios, factor=3.0):
    """64 all-reduces of 4 B against one: both are timed in the same rounds, so load slows both
    alike and their ratio keeps the model honest where the band is wide. Measured, 64 calls take
    about 64 times one (alpha paid per call); a model must predict that within `factor`.
    One that pays alpha once per step predicts about 1, 64 times off. [] if it holds."""
    r = ratios["64 all-reduces of 4 B"] / ratios["one 4 B all-reduce"]
    if 1 / factor <= r <= factor:
        return []
    return [f"64 all-reduces of 4 B against one: measured / predicted differ by {r:.1f}x, more than "
            f"{factor:.0f}x, though load slows both alike: does the model pay alpha once per all-reduce?"]
