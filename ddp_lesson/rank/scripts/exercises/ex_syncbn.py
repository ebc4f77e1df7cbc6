"""Exercise (notebook 04): BatchNorm running statistics that agree, without SyncBatchNorm.

    torchrun --standalone --nproc-per-node 2 ex_syncbn.py
Each rank trains a few steps with plain BatchNorm on its own shard of batch 4.
`forward_sync_buffers=False`, so DDP does not copy rank 0's buffers over the others at each
forward: each rank's running statistics come from its own batches. DDP(...) still copies them
once, at init, when they are equal anyway. The script logs them, runs the lines
marked # EXERCISE, and logs them again. Your job: make every rank hold the average over
ranks of each BN layer's running mean and running variance.
"""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_lesson import data, metrics, models

STEPS, BATCH = 4, 4


def stats(bns):
    """Every BN layer's running mean and variance, as lists for the log."""
    return {"running_mean": [m.running_mean.tolist() for m in bns],
            "running_var": [m.running_var.tolist() for m in bns]}


@record
def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")  # DDP
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")

    train_set = data.shapes(BATCH * STEPS * dist.get_world_size(), seed=0)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)  # DDP: a shard per rank
    loader = DataLoader(train_set, batch_size=BATCH, sampler=sampler)
    model = models.SmallCNN(width=8).to(device)
    model = DDP(model, device_ids=[local_rank] if use_cuda else None,
                forward_sync_buffers=False)  # DDP: no buffer copy per forward (one at init)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    for step, (x, y) in enumerate(loader, 1):
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        metrics.log(step, loss=loss)
    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    metrics.log(step, bn_types=[type(m).__name__ for m in bns], own=stats(bns))  # before

    # EXERCISE: every rank ends with the average over ranks of each BN layer's
    # running_mean and running_var (bns is this rank's list of BN layers)
    pass  # your answer here

    metrics.log(step, after=stats(bns))
    dist.destroy_process_group()  # DDP


if __name__ == "__main__":
    main()
