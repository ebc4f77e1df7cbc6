"""Your first run on several ranks: every rank trains the same tiny model on its own shard of
the data, and after each backward the ranks average their gradients with one all_reduce.
That average is the idea DistributedDataParallel automates (notebook 03).

    torchrun --standalone --nproc-per-node 2 first_run.py
"""
import os

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_lesson.rank import metrics

LR = 0.1     # <- EDIT ME: try 0.3, then 1.5. Run this cell to save, then press Run below.
STEPS = 30


def make_data(n=840):
    """The whole data set, the same on every rank: y = 3*x0 - 2*x1 + 1, plus noise, sorted
    by y. 840 samples split evenly over 1 to 8 ranks."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 2, generator=g)
    y = x @ torch.tensor([3.0, -2.0]) + 1 + 0.1 * torch.randn(n, generator=g)
    order = y.argsort()           # sorted: each rank's shard holds a different range of y
    return x[order], y[order].unsqueeze(1)


@record  # if a rank raises, its traceback reaches the notebook
def main():
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")   # join the other ranks
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])                 # this process's number on this machine
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    print(f"rank {rank} of {world}, local rank {local_rank}, device {device}", flush=True)

    x, y = make_data()
    x, y = x.chunk(world)[rank].to(device), y.chunk(world)[rank].to(device)   # this rank's shard

    torch.manual_seed(0)                                       # the same starting model on every rank
    model = torch.nn.Linear(2, 1).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    metrics.log_process(lr=LR)                                 # pids and ports, for the process-tree pictures
    for step in range(STEPS):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)   # sum this gradient over all ranks, the result on every rank
            p.grad /= world           # the average: every rank takes the same step
        opt.step()
        weights = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
        metrics.log(step, loss=loss, weights=weights)
    print(f"rank {rank}: loss {loss.item():.4f} after {STEPS} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
