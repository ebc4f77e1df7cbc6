"""The smallest real DDP program: join the group, all_reduce once, leave."""
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
if dist.get_rank() == 0:
    print(f"hello from {dist.get_world_size()} ranks, sum {t.item():g}")
dist.destroy_process_group()
