"""torchrun (the current launcher): every rank reads RANK, LOCAL_RANK, WORLD_SIZE from its
environment; init_process_group reads MASTER_ADDR/MASTER_PORT from it too.
    torchrun --standalone --nproc-per-node 2 hello_torchrun.py
"""
import os

import torch
import torch.distributed as dist

use_cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if use_cuda else "gloo")
if use_cuda:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
t = torch.ones(1, device="cuda" if use_cuda else "cpu")  # nccl needs GPU tensors
dist.all_reduce(t)
print(f"torchrun: rank {os.environ['RANK']} local_rank {os.environ['LOCAL_RANK']} "
      f"world {os.environ['WORLD_SIZE']} sum {t.item():.0f}", flush=True)
dist.destroy_process_group()
