"""Lesson 09: every collective torch's DDP issues, counted, and the rule that predicts them.

count_ddp runs DDP's constructor, training steps, evaluation forwards and an accumulation
window under torch.profiler and counts the collectives this rank issued; expected_counts is
the rule. Load it on every rank: `ddp_collectives = load_script("work/ddp_collectives.py")`.
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


def phases(steps=3):
    """What count_ddp runs after the constructor, in order: (phase, kind). Kinds: "step" is
    forward, backward, optimizer step; "eval" a forward under torch.no_grad(); "no_sync" a
    forward and backward inside net.no_sync(); "last micro" the window's last micro-batch,
    forward and backward outside no_sync(), then the optimizer step."""
    return ([(f"step {s}", "step") for s in range(1, steps + 1)]
            + [("no_grad forward 1", "eval"), ("no_grad forward 2", "eval"), ("step after no_grad", "step"),
               ("no_sync micro 1", "no_sync"), ("no_sync micro 2", "no_sync"), ("last micro", "last micro")])


def count_ddp(model, steps=3, **ddp_kwargs):
    """Collectives per phase: DDP's constructor, then every phase of phases(steps)."""
    counts = {}
    net, counts["construct"] = collectives_in(lambda: DDP(model, **ddp_kwargs))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))

    def run(kind):
        if kind == "eval":
            with torch.no_grad():
                net(x)
            return
        if kind == "no_sync":
            with net.no_sync():
                F.cross_entropy(net(x), y).backward()
            return
        F.cross_entropy(net(x), y).backward()      # "step" and "last micro"
        opt.step()
        opt.zero_grad()
    for phase, kind in phases(steps):
        _, counts[phase] = collectives_in(lambda: run(kind))
    return counts


def dtypes(tensors):
    """How many broadcasts a list of tensors takes: one per dtype (each under 250 MiB)."""
    return len({t.dtype for t in tensors})


def expected_counts(model, buckets, steps=3, find_unused_parameters=False):
    """The rule, for DDP's other defaults. `buckets`: how many buckets the cap makes.
    The world size does not appear: DDP issues every one of these at 1 rank too."""
    params, buffers = list(model.parameters()), list(model.buffers())
    counts = {"construct": {"allgather": 1,               # every rank's parameter count
                            "broadcast": 1 + dtypes(params + buffers)}}  # shapes, then states
    sync_buffers = True        # DDP's require_forward_param_sync: True after the constructor
    synced_backwards = 0
    rebuild = False            # the layout waits for the first forward with gradients after step 1
    for phase, kind in phases(steps):
        c = {"broadcast": dtypes(buffers) if sync_buffers else 0, "allreduce": 0}
        # the NEXT forward syncs the buffers only after a training forward outside no_sync()
        sync_buffers = kind in ("step", "last micro")
        if kind != "eval" and rebuild:
            c["broadcast"] += 2                           # the rebuilt layout, from rank 0
            rebuild = False
        if kind in ("step", "last micro"):                # a backward that all-reduces
            synced_backwards += 1
            if find_unused_parameters:                    # buckets by the cap from step 1,
                c["allreduce"] = buckets + 1              # plus the map of used parameters
            else:
                c["allreduce"] = 1 if synced_backwards == 1 else buckets  # step 1: one bucket
                rebuild = synced_backwards == 1
        counts[phase] = c
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
