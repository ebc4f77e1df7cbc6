"""Exercise (notebook 05): which micro-batches all-reduce? no_sync() in four places.

    torchrun --standalone --nproc-per-node 2 ex_no_sync.py
Runs one accumulation window of K = 4 micro-batches for each of four placements of
model.no_sync(), each on a fresh DDP model. A communication hook counts the all-reduces DDP
launches, and every micro-batch logs how many its forward and backward caused
(`all_reduces`), so the notebook can read, per placement, which micro-batches all-reduced.
After each placement's optimizer step it logs how far apart the ranks' weights are.
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

from ddp_lesson.rank import data, metrics, models

K, BATCH = 4, 4   # one window of 4 micro-batches of 4 samples, per rank and placement


class Count:
    def __init__(self):
        self.process_group, self.calls = None, 0  # process_group None: the default group, all ranks


def counting_hook(state, bucket):  # DDP's default all-reduce, counted
    state.calls += 1
    return allreduce_hook(state.process_group, bucket)


def micro_batch(model, x, y, placement, last):
    """Forward and backward of one micro-batch, with no_sync() where `placement` puts it."""
    skip = model.no_sync() if not last else contextlib.nullcontext()  # all but the last
    if placement == "no_sync around backward only":
        loss = F.cross_entropy(model(x), y) / K
        with skip:
            loss.backward()
    elif placement == "no_sync around forward only":
        with skip:
            loss = F.cross_entropy(model(x), y) / K
        loss.backward()
    elif placement == "no_sync around forward and backward":
        with skip:
            loss = F.cross_entropy(model(x), y) / K
            loss.backward()
    elif placement == "no_sync on the last micro-batch only":  # the condition turned around
        with model.no_sync() if last else contextlib.nullcontext():
            loss = F.cross_entropy(model(x), y) / K
            loss.backward()
    return loss


PLACEMENTS = ("no_sync around backward only", "no_sync around forward only",
              "no_sync around forward and backward", "no_sync on the last micro-batch only")


def run_placements(device, device_ids=None):
    """The four placements, each on a fresh DDP model, in the current process group; logs a
    row per micro-batch. accum_nosync.py calls this too, so notebook 05 needs one launch."""
    train_set = data.shapes(BATCH * K * dist.get_world_size(), seed=0)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)  # DDP: a shard per rank
    loader = DataLoader(train_set, batch_size=BATCH, sampler=sampler)
    step = 0
    for placement in PLACEMENTS:
        model = DDP(models.SmallCNN(width=8, norm=False).to(device), device_ids=device_ids)  # DDP
        count = Count()
        model.register_comm_hook(count, counting_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for i, (x, y) in enumerate(loader):
            before = count.calls
            loss = micro_batch(model, x.to(device), y.to(device), placement, last=i == K - 1)
            step += 1
            metrics.log(step, placement=placement, micro_batch=i + 1, loss=loss,
                        all_reduces=count.calls - before)
        opt.step()
        opt.zero_grad(set_to_none=True)
        flat = torch.cat([q.detach().flatten() for q in model.parameters()])
        hi, lo = flat.clone(), flat.clone()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)  # the ranks' largest and smallest value of each weight
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        metrics.log(step, placement=placement, weights_spread=(hi - lo).max().item())  # 0: equal weights


@record
def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")  # DDP
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    run_placements(device, [local_rank] if use_cuda else None)
    dist.destroy_process_group()  # DDP


if __name__ == "__main__":
    main()
