"""Rank side of ddp_lesson.launcher.scaling (notebook 06, bench/scaling.py): one launch per rank
count. Every rank trains SmallCNN on the built-in `shapes` data with a fixed per-rank batch;
rank 0 logs one row: epoch_s, step_s (median step of a real DDP epoch), compute_s and
compute_max_s (steps under `no_sync`: no all-reduce), allreduce_s (one all_reduce as large
as all gradients), and the CPU seconds of the same steps (compute_cpu_s, step_cpu_s) with
cpu_share = compute CPU / compute wall time: below 1 when the rank waited for a core.
With --extras the same processes also run the all-reduce sweep
(ddp_lesson.rank.costmodel) and the DDP knobs (ddp_lesson.rank.knobs), which saves launches.
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_lesson.rank import costmodel, data, knobs, metrics, models


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--compute-steps", type=int, default=8)
    p.add_argument("--extras", action="store_true", help="also run the all-reduce sweep and the DDP knobs")
    a = p.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        torch.set_num_threads(1)  # one rank = one core
        device = torch.device("cpu")
    sync = torch.cuda.synchronize if use_cuda else (lambda: None)

    torch.manual_seed(0)
    train = data.shapes(a.samples, seed=0)
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=a.batch_size, sampler=sampler, drop_last=True)
    model = DDP(models.SmallCNN(width=a.width).to(device), device_ids=[local] if use_cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batches = [(x.to(device), y.to(device)) for x, y in loader]

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for x, y in batches[:3]:  # warm-up (first-iteration bucket rebuild, allocator)
        step(x, y)

    def timed(fn, n, together=False):
        """Wall and CPU seconds of each of n calls. CPU time (this process, all its threads)
        counts only while the rank runs on a core: a crowded machine stretches the wall time
        far more than the CPU time. together: every rank starts each call at the same moment."""
        wall, cpu = [], []
        for i in range(n):
            if together:
                dist.barrier()
            sync()
            t, c = time.perf_counter(), time.process_time()
            fn(i)
            sync()
            wall.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        return wall, cpu

    # one real epoch, every step timed: the sum is the epoch, the median is robust to the
    # bursts of other people's work on a shared machine
    sampler.set_epoch(1)
    dist.barrier()
    times, step_cpu = timed(lambda i: step(*batches[i]), len(batches))
    epoch_s, step_s = sum(times), statistics.median(times)
    # compute only: the same step with the gradient all-reduce switched off, timed after the
    # epoch (warm, like its steps) and started together on every rank, as a DDP step is
    with model.no_sync():
        ctimes, ccpu = timed(lambda i: step(*batches[i % len(batches)]), a.compute_steps, together=True)
    compute_s, compute_cpu_s = statistics.median(ctimes), statistics.median(ccpu)
    # in a synchronised step everyone waits for the slowest rank: per step, the max over ranks
    every = [torch.zeros(len(ctimes), dtype=torch.float64, device=device) for _ in range(world)]
    dist.all_gather(every, torch.tensor(ctimes, dtype=torch.float64, device=device))
    compute_max_s = statistics.median(torch.stack(every).max(0).values.tolist())
    # the all-reduce alone: one flat tensor as large as all the gradients
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    flat = torch.zeros(nbytes // 4, device=device)
    dist.all_reduce(flat)
    dist.barrier()
    allreduce_s = statistics.median(timed(lambda i: dist.all_reduce(flat), 10, together=True)[0])
    # the slowest rank sets the pace of all; the CPU share: the least any rank got of a core
    m = torch.tensor([epoch_s, step_s, compute_s, allreduce_s, compute_cpu_s, statistics.median(step_cpu)],
                     dtype=torch.float64, device=device)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    share = torch.tensor([compute_cpu_s / compute_s], dtype=torch.float64, device=device)
    dist.all_reduce(share, op=dist.ReduceOp.MIN)
    epoch_s, step_s, compute_s, allreduce_s, compute_cpu_s, step_cpu_s = m.tolist()
    if rank == 0:
        metrics.log(0, world_size=world, epoch_s=epoch_s, steps=len(batches), step_s=step_s,
                    compute_s=compute_s, compute_max_s=compute_max_s, allreduce_s=allreduce_s, grad_bytes=nbytes,
                    compute_cpu_s=compute_cpu_s, step_cpu_s=step_cpu_s, cpu_share=share.item(),
                    samples_per_s=len(batches) * a.batch_size * world / epoch_s,
                    backend=dist.get_backend(), device=str(device))
    if a.extras:  # the all-reduce sweep and the DDP knobs in the same processes (saves launches)
        sweep = costmodel.sweep(costmodel.QUICK_SIZES, iters=6, device=device)
        knob_rows = knobs.measure_configs(device, quick=True)
        if rank == 0:
            for i, (b, sec) in enumerate(sweep):
                metrics.log(i, kind="allreduce", bytes=b, seconds=sec, world_size=world,
                            backend=dist.get_backend())
            for i, r in enumerate(knob_rows):
                metrics.log(i, kind="knobs", world_size=world, backend=dist.get_backend(), **r)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
