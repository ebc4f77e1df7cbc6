"""Check (notebook 05): gradient accumulation and no_sync().

1. In one process: k micro-batches of b with loss/k give the gradient of one k*b batch
   (model without BN); with BN in training mode they do not, and we report by how much.
2. In DDP, counted by a communication hook: with no_sync() on all but the last micro-batch,
   one all-reduce per optimizer step (per gradient bucket); without it, k. Same weights.
3. Time per optimizer step with and without no_sync, side by side.
4. Accumulation windows: ddp_accum.py's own loop, its function `accumulate` (--loop PATH: the
   learner's copy), over 10 micro-batches with k = K, so the last window is short. Measured: each
   micro-batch's optimizer step and all-reduces, each step's gradient against the mean gradient
   of its window over all ranks, and how far the ranks' weights end apart (notebook 05 draws
   and checks these).
Writes accum.json. Then, in the same launch, the four no_sync placements of the exercise
script ex_no_sync.py (its rows go to this run's metrics, which the exercise reads).
"""
import contextlib
import importlib.util
import copy
import math
import sys
import time
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lesson.rank import bundled, data, metrics, models

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


class Watched:
    """The optimizer the accumulation loop steps, watched: at each step() it compares the
    gradient with the reference, the mean gradient of the window's samples over all ranks."""
    def __init__(self, model, micro):
        self.model, self.micro, self.opt = model, micro, torch.optim.SGD(model.parameters(), lr=0.05)
        self.start, self.steps = copy.deepcopy(model.module), []

    def step(self):
        ref, m = self.start, len(self.micro)      # the weights at the window's start
        ref.zero_grad(set_to_none=True)
        for x, y in self.micro:
            (F.cross_entropy(ref(x), y) / m).backward()
        want = grads(ref)
        dist.all_reduce(want)
        want /= dist.get_world_size()             # DDP's gradient: the mean over ranks
        got = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                         for p in self.model.parameters()])
        self.steps.append({"micro_batches": m,
                           "grad_rel_err": ((got - want).abs().max() / want.abs().max()).item(),
                           "divided_by": round(m * want.dot(want).item() / (want.dot(got).item() or math.nan), 3)})
        self.opt.step()
        self.start, self.micro[:] = copy.deepcopy(self.model.module), []

    def zero_grad(self, set_to_none=True):
        self.opt.zero_grad(set_to_none=set_to_none)


def window_rows(base, loop, n=10, k=K):
    """Run an accumulation loop (ddp_accum.py's `accumulate`, the learner's copy) over n
    micro-batches, k per optimizer step, and measure it: one row per micro-batch with its
    optimizer step, its window and the all-reduces its forward and backward launched (a
    comm hook counts them); per step, the gradient against the reference; the ranks' weights."""
    model = DDP(copy.deepcopy(base))
    state = Counter()
    model.register_comm_hook(state, counting_hook)
    x, y = data.shapes(n * B, seed=5 + dist.get_rank()).tensors
    micro, calls = [], []                         # this window's micro-batches; hook calls so far
    opt = Watched(model, micro)

    def batches():                                # hands out micro-batches, noting the hook calls
        for xi, yi in zip(x.chunk(n), y.chunk(n)):
            calls.append((state.calls, len(opt.steps)))
            micro.append((xi, yi))
            yield xi, yi

    for _ in loop(model, opt, types.SimpleNamespace(step=lambda: None), batches(), k, n, torch.device("cpu")):
        pass
    calls.append((state.calls, len(opt.steps)))
    sizes = [s["micro_batches"] for s in opt.steps]
    rows = [{"micro_batch": i + 1, "step": s + 1, "window": sizes[s] if s < len(sizes) else None,
             "all_reduces": calls[i + 1][0] - c}
            for i, (c, s) in enumerate(calls[:-1])]
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"rows": rows, "steps": opt.steps, "weights": weights.tolist()})
    spread = max(max(abs(a - b) for a, b in zip(e["weights"], every[0]["weights"])) for e in every)
    return {"n": n, "k": k, "rows": [e["rows"] for e in every], "steps": [e["steps"] for e in every],
            "weights_spread": spread}


def ddp_accum_loop():
    """`accumulate` from the ddp_accum.py named by --loop PATH (the learner's copy), else from
    the lesson script."""
    path = sys.argv[sys.argv.index("--loop") + 1] if "--loop" in sys.argv else bundled.script("ddp_accum.py")
    spec = importlib.util.spec_from_file_location("ddp_accum_checked", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)              # its main() runs only as a script
    return module.accumulate


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
    out["windows"] = window_rows(base, ddp_accum_loop())
    if rank == 0:
        metrics.save_json("accum.json", out)
    exercise = bundled.load(bundled.script("ex_no_sync.py"))   # the exercise's script: one launch instead of two
    exercise.run_placements(torch.device("cpu"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
