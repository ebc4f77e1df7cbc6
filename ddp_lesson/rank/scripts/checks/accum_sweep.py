"""Experiment (notebook 05): a published accumulation table's shape in one launch, on CPU ranks.

One process on the global batch (rank 0 alone; the other ranks wait), then all ranks with
accumulation steps k = 1, 2, ... (no_sync on all but the last micro-batch): time per epoch,
time per optimizer step, optimizer steps and test accuracy, all with the same lr and
epochs. Writes sweep.json.
    python -m ddp_lesson run accum_sweep.py --nproc 2 -- --ks 1,4,16,64
"""
import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from ddp_lesson.rank import data, metrics, models


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--ks", default="1,4,16,64")
    p.add_argument("--batch-size", type=int, default=8, help="per process (micro-batch)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--train-samples", type=int, default=2048)
    p.add_argument("--width", type=int, default=16, help="model width: more weights, more to all-reduce")
    return p.parse_args()


def accuracy(model, device):
    x, y = data.shapes_split(train=False).tensors
    model.eval()
    with torch.no_grad():
        acc = (model(x.to(device)).argmax(1) == y.to(device)).float().mean().item()
    model.train()
    return acc


def train(model, x, y, batch, k, epochs, lr, sampler=None):
    """Returns (seconds, optimizer steps). k micro-batches of `batch` per optimizer step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
    sync()  # on GPUs: wait for queued work, so that the clock measures the training itself
    steps, t0 = 0, time.perf_counter()
    for epoch in range(epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
            idx = torch.tensor(list(sampler))
        else:
            idx = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        n = len(idx) // batch
        for i in range(n):
            mb = idx[i * batch:(i + 1) * batch]
            window = min(k, n - i // k * k)  # the last window may be short
            last = (i + 1) % k == 0 or i + 1 == n
            ctx = model.no_sync() if (isinstance(model, DDP) and not last) else contextlib.nullcontext()
            with ctx:
                (F.cross_entropy(model(x[mb]), y[mb]) / window).backward()
            if last:
                opt.step()
                opt.zero_grad(set_to_none=True)
                steps += 1
    sync()
    return time.perf_counter() - t0, steps


def main():
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    x, y = data.shapes_split(train=True).tensors
    x, y = x[:args.train_samples].to(device), y[:args.train_samples].to(device)
    rows = []

    torch.manual_seed(0)
    if rank == 0:  # "one card": one process, the global batch, k = 1
        model = models.SmallCNN(width=args.width).to(device)
        seconds, steps = train(model, x, y, args.batch_size * world, 1, args.epochs, args.lr)
        rows.append({"setup": "1 process", "k": 1, "seconds": seconds, "optimizer_steps": steps,
                     "test_accuracy": accuracy(model, device)})
    dist.barrier()
    for k in [int(v) for v in args.ks.split(",")]:
        torch.manual_seed(0)
        model = DDP(models.SmallCNN(width=args.width).to(device), device_ids=[local_rank] if use_cuda else None)
        sampler = DistributedSampler(range(len(x)), shuffle=True, seed=0)
        seconds, steps = train(model, x, y, args.batch_size, k, args.epochs, args.lr, sampler)
        t = torch.tensor([seconds], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        setup = f"DDP, {world} rank{'s' if world > 1 else ''}"  # not "1 process": that is the row above
        rows.append({"setup": setup, "k": k, "seconds": t.item(), "optimizer_steps": steps,
                     "test_accuracy": accuracy(model.module, device)})
    if rank == 0:
        for r in rows:
            r["ms_per_optimizer_step"] = 1000 * r["seconds"] / r["optimizer_steps"]
        metrics.save_json("sweep.json", {"args": vars(args), "world_size": world, "rows": rows})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
