"""Exercise (notebook 03): write the sampler: a shard per rank, a new shuffle every epoch.

    torchrun --standalone --nproc-per-node 2 ex_set_epoch.py
Trains a small model for 3 epochs on 96 samples and logs, every step, which samples this
rank trained on (`indices`), so a checker can read the order back from the run directory.
The sampler is ShardSampler, written here instead of DistributedSampler. Your job: write its
__iter__ (the line marked # your answer here), so that the ranks' shards are disjoint and
cover the data, and every epoch brings a new order and, for every rank, a new set of samples.
"""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler, TensorDataset

from ddp_lesson.rank import data, metrics, models

EPOCHS, SAMPLES, BATCH = 3, 96, 8   # 96 splits evenly over 1, 2, 3, 4, 6 or 8 ranks: no padding


class ShardSampler(Sampler):
    """This rank's share of the indices 0 .. n-1 for the current epoch."""

    def __init__(self, n, rank, world_size, seed=0):
        self.n, self.rank, self.world_size, self.seed = n, rank, world_size, seed
        self.epoch = 0

    def set_epoch(self, epoch):  # the training loop calls this at the top of every epoch
        self.epoch = epoch

    def __len__(self):
        return len(range(self.rank, self.n, self.world_size))

    def __iter__(self):
        # EXERCISE: this rank's indices, in this epoch's order
        return iter(range(self.rank, self.n, self.world_size))  # your answer here


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
    sampler = ShardSampler(SAMPLES, dist.get_rank(), dist.get_world_size(), seed=0)
    loader = DataLoader(train_set, batch_size=BATCH, sampler=sampler)
    model = DDP(models.SmallCNN(width=8).to(device),
                device_ids=[local_rank] if use_cuda else None)     # DDP
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    step = 0
    metrics.log(step, samples=len(train_set))  # the data set's size, for the checker
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)  # before the loader asks the sampler for this epoch's order
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
