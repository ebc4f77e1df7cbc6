"""Lesson 09: every collective torch's DDP issues, counted, and the rule that predicts them.

count_ddp runs DDP's constructor and a few training steps under torch.profiler and counts
the collectives this rank issued; expected_counts is the rule. Load it on every rank:
`ddp_collectives = load_script("work/ddp_collectives.py")`.
"""
import collections

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile


def collectives_in(fn):
    """Run fn() and return (its result, {collective: calls}) for this rank. Every collective,
    called from Python or from DDP's C++ Reducer, is a `c10d::<name>_` op the profiler sees."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = fn()
    calls = collections.Counter(e.name[len("c10d::"):].rstrip("_")
                                for e in prof.events() if e.name.startswith("c10d::"))
    return result, dict(calls)


def tiny_net(batchnorm):
    """Linear-ReLU-Linear, with a BatchNorm1d (3 buffers: 2 float32, 1 int64) if asked."""
    norm = [nn.BatchNorm1d(32)] if batchnorm else []
    return nn.Sequential(nn.Linear(16, 32), *norm, nn.ReLU(), nn.Linear(32, 4))


def count_ddp(model, steps=3, **ddp_kwargs):
    """Collectives per phase: DDP's constructor, `steps` training steps (forward, backward,
    optimizer step), then one forward under torch.no_grad()."""
    counts = {}
    net, counts["construct"] = collectives_in(lambda: DDP(model, **ddp_kwargs))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))

    def train_step():
        F.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    for s in range(1, steps + 1):
        _, counts[f"step {s}"] = collectives_in(train_step)
    with torch.no_grad():
        _, counts["no_grad forward"] = collectives_in(lambda: net(x))
    return counts


def dtypes(tensors):
    """How many broadcasts a list of tensors takes: one per dtype (each under 250 MiB)."""
    return len({t.dtype for t in tensors})


def expected_counts(model, buckets, steps=3, find_unused_parameters=False):
    """The rule, for DDP's other defaults. `buckets`: how many buckets the cap makes.
    The world size does not appear: DDP issues every one of these at 1 rank too."""
    params, buffers = list(model.parameters()), list(model.buffers())
    per_forward = {"broadcast": dtypes(buffers)}          # rank 0's buffers, every forward
    counts = {"construct": {"allgather": 1,               # every rank's parameter count
                            "broadcast": 1 + dtypes(params + buffers)}}  # shapes, then states
    for s in range(1, steps + 1):
        step = dict(per_forward)
        if find_unused_parameters:                        # buckets by the cap from step 1,
            step["allreduce"] = buckets + 1               # plus the map of used parameters
        else:
            step["allreduce"] = 1 if s == 1 else buckets  # step 1: one bucket; then rebuilt
            if s == 2:
                step["broadcast"] += 2                    # the rebuilt layout, from rank 0
        counts[f"step {s}"] = step
    counts["no_grad forward"] = dict(per_forward)
    return {phase: {k: n for k, n in c.items() if n} for phase, c in counts.items()}


def check_counts(counted, expected):
    """What differs between each rank's counts ([{model: {phase: counts}}], one per rank)
    and the rule's: [] when nothing does."""
    wrong = []
    for r, per_model in enumerate(counted):
        for name, phases in expected.items():
            got = per_model.get(name, {})
            for phase in sorted(set(phases) | set(got)):
                if got.get(phase) != phases.get(phase):
                    wrong.append(f"rank {r}, {name}, {phase}: counted {got.get(phase)}, rule {phases.get(phase)}")
    return wrong
