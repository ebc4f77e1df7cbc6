"""Script side helpers for plumbing that is not the lesson: rank-0 printing and
reductions for logging. They also work in a plain process (no process group): world
size 1, rank 0. Lesson scripts still call init_process_group & co. themselves."""
import os

import torch
import torch.distributed as dist


def is_distributed():
    return dist.is_available() and dist.is_initialized()


def rank():
    return dist.get_rank() if is_distributed() else int(os.environ.get("RANK", "0"))


def world_size():
    return dist.get_world_size() if is_distributed() else int(os.environ.get("WORLD_SIZE", "1"))


def is_main():
    return rank() == 0


def print0(*args, **kwargs):
    """print() on rank 0 only (flushed, so a launcher tailing the log sees it at once)."""
    if is_main():
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def reduce_mean(value):
    """Mean of `value` (number or tensor) over ranks, a new tensor on CPU; for logging only
    (the loss for backward is never reduced by hand)."""
    t = torch.as_tensor(value, dtype=torch.float64).clone()
    if is_distributed():
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t)
    return t.cpu() / world_size()
