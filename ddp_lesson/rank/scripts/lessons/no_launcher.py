"""One script for both worlds: distributed under a launcher, a single process without.
The init_distributed_mode pattern of WZ's train_multi_GPU code: no RANK/WORLD_SIZE in the environment means no
launcher started us, so say "Not using distributed mode" and train on one process.

    python no_launcher.py                                  # one process
    torchrun --standalone --nproc-per-node 2 no_launcher.py  # DDP
"""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_lesson.rank import data, models


def init_distributed_mode():
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        return True
    print("Not using distributed mode", flush=True)
    return False


def main():
    distributed = init_distributed_mode()
    rank = dist.get_rank() if distributed else 0
    train = data.shapes(512, seed=0)
    sampler = DistributedSampler(train, seed=0) if distributed else None
    loader = DataLoader(train, batch_size=64, sampler=sampler, shuffle=sampler is None, drop_last=True)
    torch.manual_seed(0)
    model = models.SmallCNN(width=8)
    if distributed:
        model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    world = dist.get_world_size() if distributed else 1
    if rank == 0:
        print(f"trained {len(loader)} steps on {world} process(es), last loss {loss.item():.3f}", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
