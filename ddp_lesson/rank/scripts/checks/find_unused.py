"""Check (notebook 03b): find_unused_parameters, when it is needed and what it costs.

A model with a branch that only some steps use. Without find_unused_parameters=True, DDP
waits for gradients of the unused branch that never come and fails on the next step; with
it, DDP walks the autograd graph every step to mark them ready. Writes find_unused.json
(check() does the work; notebook 03b runs it after ddp_equivalence.py and ddp_checks.py in
one launch, checks_03b.py).
"""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lesson.rank import data, metrics, models


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = models.SmallCNN(norm=False)
        self.extra = nn.Linear(10, 10)  # used only when asked

    def forward(self, x, use_extra=False):
        out = self.body(x)
        return self.extra(out) if use_extra else out


def train(ddp, steps, use_extra_every=0):
    x, y = data.shapes(32, seed=dist.get_rank()).tensors
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    t0 = time.perf_counter()
    for i in range(steps):
        use = bool(use_extra_every) and i % use_extra_every == 0
        opt.zero_grad()
        F.cross_entropy(ddp(x, use_extra=use), y).backward()
        opt.step()
    return (time.perf_counter() - t0) / steps


def check():
    torch.manual_seed(0)
    out = {}
    try:  # the branch is unused on step 2: DDP notices on step 3
        train(DDP(TwoHeads()), steps=3, use_extra_every=2)
        out["error_without_flag"] = None
    except RuntimeError as e:
        out["error_without_flag"] = str(e).split("\n")[0]
    dist.barrier()
    out["ms_per_step_with_flag_branchy"] = 1000 * train(DDP(TwoHeads(), find_unused_parameters=True), 6, 2)
    # The cost on a model that uses every parameter: same model, flag off vs on, side by side.
    plain = DDP(models.SmallCNN(norm=False))
    flagged = DDP(models.SmallCNN(norm=False), find_unused_parameters=True)
    times = {"off": [], "on": []}
    for _ in range(3):
        for name, m in (("off", plain), ("on", flagged)):
            times[name].append(1000 * _time(m))
    out["ms_per_step_flag_off"] = min(times["off"])
    out["ms_per_step_flag_on"] = min(times["on"])
    if dist.get_rank() == 0:
        metrics.save_json("find_unused.json", out)
    dist.barrier()


def main():
    dist.init_process_group("gloo")
    check()
    # The DDP object that failed still waits for the unused gradient; tearing it down can
    # abort the process ("terminate called without an active exception"). Leave without
    # running its destructor: everything this check had to say is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _time(ddp, steps=10):
    x, y = data.shapes(32, seed=dist.get_rank()).tensors
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    return (time.perf_counter() - t0) / steps


if __name__ == "__main__":
    main()
