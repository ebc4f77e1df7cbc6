"""Rank 1 never reaches the collective that rank 0 waits in."""
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
print(f"ready rank {dist.get_rank()}", flush=True)
if dist.get_rank() == 1:
    while True:
        time.sleep(1)
t = torch.ones(1)
dist.all_reduce(t)
