"""Exercise (lesson 11): the same global batch at any world size.

    torchrun --standalone --nproc-per-node 2 ex_global_batch.py
Each optimizer step should see GLOBAL samples in all, whatever the number of ranks, so that
a run on 1, 2, 3 or 4 ranks trains the same model. Every rank logs how many samples it
used in each step (`samples`), so a checker can add them up from the run directory.
Your job: make ACCUM, the micro-batches per rank per step, give GLOBAL at any world size.
Where no whole number of micro-batches per rank can (48 in micro-batches of 4 on 5 ranks),
refuse at the # EXERCISE line, before training: raise SystemExit(message), or an exception
or an assert with a message, saying why. The checker reads GLOBAL and MICRO from the
metrics.log(0, ...) line above it, and takes any other failure for a crash, not a refusal.
"""
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_lesson.rank import data, metrics, models

GLOBAL, MICRO, STEPS = 48, 4, 3   # samples per optimizer step (all ranks), per micro-batch


@record
def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")  # DDP
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    world_size = dist.get_world_size()
    metrics.log(0, global_batch_asked=GLOBAL, micro_batch=MICRO, world=world_size)

    # EXERCISE: change the next line
    ACCUM = 8  # micro-batches per rank per optimizer step
    train_set = data.shapes(GLOBAL * STEPS * 4, seed=0)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)  # DDP: a shard per rank
    loader = iter(DataLoader(train_set, batch_size=MICRO, sampler=sampler, drop_last=True))
    model = DDP(models.SmallCNN(width=8, norm=False).to(device),
                device_ids=[local_rank] if use_cuda else None)  # DDP
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(1, STEPS + 1):
        samples = 0
        for i in range(ACCUM):
            x, y = next(loader)
            with contextlib.nullcontext() if i == ACCUM - 1 else model.no_sync():  # DDP
                (F.cross_entropy(model(x.to(device)), y.to(device)) / ACCUM).backward()
            samples += len(y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        metrics.log(step, samples=samples, accum=ACCUM)
    dist.destroy_process_group()  # DDP


if __name__ == "__main__":
    main()
