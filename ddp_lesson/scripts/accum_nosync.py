"""Check (notebook 05): gradient accumulation and no_sync().

1. In one process: k micro-batches of b with loss/k give the gradient of one k*b batch
   (model without BN); with BN in training mode they do not, and we report by how much.
2. In DDP, counted by a communication hook: with no_sync() on all but the last micro-batch,
   one all-reduce per optimizer step (per gradient bucket); without it, k. Same weights.
3. Time per optimizer step with and without no_sync, side by side.
4. Accumulation windows: ddp_accum.py's loop lines (window, last, no_sync) over N micro-batches
   with k = K, so the last window is short; each micro-batch logs its window and how many
   all-reduces its forward and backward launched (notebook 05 draws these rows).
Writes accum.json. Then, in the same launch, the four no_sync placements of the exercise
script ex_no_sync.py (its rows go to this run's metrics, which the exercise reads).
"""
import contextlib
import copy
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lesson import data, models

K, B, STEPS = 4, 8, 3


class Counter:
    """Comm hook state: how many all-reduces DDP launched and how many bytes they carried."""
    def __init__(self, process_group=None):
        self.process_group, self.calls, self.bytes = process_group, 0, 0


def counting_hook(state, bucket):
    state.calls += 1
    state.bytes += bucket.buffer().numel() * bucket.buffer().element_size()
    return allreduce_hook(state.process_group, bucket)  # the default: average over ranks


def grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def accumulated_vs_big(norm, x, y):
    torch.manual_seed(0)
    model = models.SmallCNN(norm=norm)
    big = copy.deepcopy(model)
    for xi, yi in zip(x.chunk(K), y.chunk(K)):
        (F.cross_entropy(model(xi), yi) / K).backward()
    F.cross_entropy(big(x), y).backward()
    g, h = grads(model), grads(big)
    return torch.allclose(g, h, atol=1e-6), (g - h).abs().max().item()


def train(model, batches, use_no_sync):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for micro in batches:  # one optimizer step per group of K micro-batches
        for j, (x, y) in enumerate(micro):
            last = j == len(micro) - 1
            ctx = model.no_sync() if (use_no_sync and not last) else contextlib.nullcontext()
            with ctx:
                (F.cross_entropy(model(x), y) / len(micro)).backward()
        opt.step()
        opt.zero_grad()


def window_rows(base, n=10, k=K):
    """ddp_accum.py's accumulation loop over n micro-batches, k per optimizer step, with its
    own `window` and `last` lines: one row per micro-batch, the all-reduces counted by a hook."""
    model = DDP(copy.deepcopy(base))
    state = Counter()
    model.register_comm_hook(state, counting_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = data.shapes(n * B, seed=5 + dist.get_rank()).tensors
    rows, step = [], 1
    for i, (xi, yi) in enumerate(zip(x.chunk(n), y.chunk(n))):
        window = min(k, n - (i - i % k))  # micro-batches in this window: the last may be short
        last = (i + 1) % k == 0 or i + 1 == n  # end of a window, or of the epoch
        before = state.calls
        with contextlib.nullcontext() if last else model.no_sync():
            (F.cross_entropy(model(xi), yi) / window).backward()
        rows.append({"micro_batch": i + 1, "step": step, "window": window,
                     "all_reduces": state.calls - before})
        if last:
            opt.step()
            opt.zero_grad()
            step += 1
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, rows)
    return {"n": n, "k": k, "rows": every}


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = data.shapes(K * B, seed=3).tensors
    exact, diff = accumulated_vs_big(False, x, y)
    exact_bn, diff_bn = accumulated_vs_big(True, x, y)
    out = {"k": K, "micro_batch": B, "steps": STEPS, "world_size": world,
           "no_bn_exact": exact, "no_bn_max_abs_diff": diff,
           "bn_exact": exact_bn, "bn_max_abs_diff": diff_bn}

    imgs, labels = data.shapes(STEPS * K * B * world, seed=4 + rank).tensors  # this rank's data
    batches = [list(zip(imgs[s * K * B:(s + 1) * K * B].chunk(K), labels[s * K * B:(s + 1) * K * B].chunk(K)))
               for s in range(STEPS)]
    torch.manual_seed(0)
    base = models.SmallCNN(norm=False)
    counts, weights = {}, {}
    for name, use in (("no_sync", True), ("sync_every_micro_batch", False)):
        model = DDP(copy.deepcopy(base))
        state = Counter()
        model.register_comm_hook(state, counting_hook)
        train(model, batches, use)
        counts[name] = {"allreduce_calls": state.calls, "bytes": state.bytes,
                        "calls_per_optimizer_step": state.calls / STEPS}
        weights[name] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out["counts"] = counts
    out["same_weights"] = torch.allclose(weights["no_sync"], weights["sync_every_micro_batch"], atol=1e-6)
    out["weights_max_abs_diff"] = (weights["no_sync"] - weights["sync_every_micro_batch"]).abs().max().item()
    out["gradient_bytes"] = sum(p.numel() * p.element_size() for p in base.parameters())

    times = {"no_sync": [], "sync_every_micro_batch": []}
    for _ in range(3):
        for name, use in (("no_sync", True), ("sync_every_micro_batch", False)):
            model = DDP(copy.deepcopy(base))
            t0 = time.perf_counter()
            train(model, batches, use)
            times[name].append(1000 * (time.perf_counter() - t0) / STEPS)
    out["ms_per_optimizer_step"] = {k: min(v) for k, v in times.items()}
    out["windows"] = window_rows(base)
    if rank == 0:
        with open(os.path.join(os.environ.get("DDP_LESSON_RUN_DIR", "."), "accum.json"), "w") as f:
            json.dump(out, f, indent=1)
    from ex_no_sync import run_placements  # a sibling script: one launch instead of two
    run_placements(torch.device("cpu"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
