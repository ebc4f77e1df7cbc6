"""mp.spawn: no launcher; the script starts its workers itself and must set MASTER_ADDR,
MASTER_PORT, rank and world size by hand. Run it as `python hello_spawn.py`, never inside a
Jupyter kernel: spawn pickles the worker function, which a notebook cannot import.
"""
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world_size):
    # no init_method: the default "env://" reads MASTER_ADDR/MASTER_PORT from the environment (set below)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"mp.spawn: rank {rank} world {world_size} sum {t.item():.0f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":  # required: spawn re-imports this file in every child
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    mp.spawn(worker, args=(2,), nprocs=2, join=True)
