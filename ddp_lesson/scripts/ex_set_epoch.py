"""Exercise (lesson 03): a shard per rank, a new shuffle every epoch.

    torchrun --standalone --nproc-per-node 2 ex_set_epoch.py
Trains a small model for 3 epochs on 96 samples and logs, every step, which samples this
rank trained on (`indices`), so a checker can read the order back from the run directory.
Your job: fix the two lines marked # EXERCISE, so that the ranks' shards are disjoint and
cover the data, and every epoch sees a different order.
"""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ddp_lesson import data, metrics, models

EPOCHS, SAMPLES, BATCH = 3, 96, 8   # 96 splits evenly over 1, 2, 3, 4, 6 or 8 ranks


@record
def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")  # DDP
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")

    images, labels = data.shapes(SAMPLES, seed=0).tensors
    train_set = TensorDataset(images, labels, torch.arange(SAMPLES))  # each sample's index too
    rank = dist.get_rank()
    sampler = DistributedSampler(train_set, shuffle=True, seed=rank)  # EXERCISE
    loader = DataLoader(train_set, batch_size=BATCH, sampler=sampler)
    model = DDP(models.SmallCNN(width=8).to(device),
                device_ids=[local_rank] if use_cuda else None)     # DDP
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    step = 0
    for epoch in range(EPOCHS):
        # EXERCISE: one line here
        for x, y, index in loader:
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()  # DDP: gradients averaged over ranks
            opt.step()
            step += 1
            metrics.log(step, loss=loss, epoch=epoch, indices=index.tolist())
    dist.destroy_process_group()  # DDP


if __name__ == "__main__":
    main()
