"""Hello, torch.distributed: every rank says who it is, then the ranks add up their numbers with all_reduce.

    torchrun --standalone --nproc-per-node 2 hello_ddp.py
"""
import os

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_lesson import metrics


@record
def main():
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")  # torchrun set RANK, WORLD_SIZE, ...
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        where = (f"cuda:{local_rank} = {torch.cuda.get_device_name(local_rank)} "
                 f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})")
    else:
        device = torch.device("cpu")
        where = "cpu"
    print(f"rank {rank} of {world}, local rank {local_rank}, pid {os.getpid()}, device {where}",
          flush=True)

    x = torch.tensor([rank + 1.0], device=device)
    dist.all_reduce(x)  # every rank ends with 1 + 2 + ... + world
    print(f"rank {rank}: all_reduce sum = {x.item():g}", flush=True)
    metrics.log(0, value=x.item(), world_size=world, pid=os.getpid())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
