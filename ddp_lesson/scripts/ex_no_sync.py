"""Exercise (lesson 05): one all-reduce per accumulation window.

    torchrun --standalone --nproc-per-node 2 ex_no_sync.py
Gradient accumulation over K micro-batches per optimizer step. A communication hook counts
the all-reduces DDP launches, and every micro-batch logs how many it caused (`all_reduces`),
so a checker can count them per window from the run directory.
Your job: make only the window's last micro-batch all-reduce, with model.no_sync().
"""
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_lesson import data, metrics, models

K, MICRO_BATCHES, BATCH = 4, 8, 4   # 2 windows of 4 micro-batches of 4 samples, per rank


class Count:
    def __init__(self):
        self.process_group, self.calls = None, 0  # process_group None: the default group, all ranks


def counting_hook(state, bucket):  # DDP's default all-reduce, counted
    state.calls += 1
    return allreduce_hook(state.process_group, bucket)


@record
def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")  # DDP
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")

    train_set = data.shapes(BATCH * MICRO_BATCHES * dist.get_world_size(), seed=0)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)  # DDP: a shard per rank
    loader = DataLoader(train_set, batch_size=BATCH, sampler=sampler)
    model = DDP(models.SmallCNN(width=8, norm=False).to(device),
                device_ids=[local_rank] if use_cuda else None)  # DDP
    count = Count()
    model.register_comm_hook(count, counting_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    for i, (x, y) in enumerate(loader):
        last = (i + 1) % K == 0 or i + 1 == len(loader)  # the window's last micro-batch
        before = count.calls
        # EXERCISE: change the next three lines
        loss = F.cross_entropy(model(x.to(device)), y.to(device)) / K
        loss.backward()  # gradients add up in .grad over the window
        after = count.calls
        if last:
            opt.step()
            opt.zero_grad(set_to_none=True)
        metrics.log(i, loss=loss, k=K, last=last, all_reduces=after - before)
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    metrics.log(i, weights_sum=weights.double().sum(), weights_abs_sum=weights.double().abs().sum())
    dist.destroy_process_group()  # DDP


if __name__ == "__main__":
    main()
