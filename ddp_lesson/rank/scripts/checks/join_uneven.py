"""Check (notebook 03c): uneven data on real ranks, without Join and with it.

Rank r gets 2 + r batches, so rank 0 runs out first. Without Join, DDP's next gradient
all-reduce on the other ranks waits for rank 0, which never joins it: on a process group with a
short timeout, TIMEOUT_S, they raise instead of hanging for the default 30 minutes. With
`with model.join():` rank 0 answers their all-reduces with zeros and every rank ends the loop;
the ranks' weights differ as each runs out, and agree only after the with, where Join copies the
last rank to finish onto every rank.
Writes join.json (one entry per rank) into the run directory.
"""
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lesson.rank import metrics

TIMEOUT_S = 3


def batches(rank):
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(2 + rank)]


def train(model, rank):
    """Steps taken; the error, if a collective failed, and when."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps, t0 = 0, time.perf_counter()
    try:
        for x, y in batches(rank):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()  # DDP's all-reduce: every rank must take part
            opt.step()
            steps += 1
    except RuntimeError as e:
        return {"steps": steps, "error": str(e).splitlines()[0][:200], "seconds": time.perf_counter() - t0}
    return {"steps": steps, "error": None, "seconds": time.perf_counter() - t0}


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def all_equal(weights, world):
    """Whether every rank holds these same weights."""
    gathered = [torch.zeros_like(weights) for _ in range(world)]
    dist.all_gather(gathered, weights)
    return all(torch.equal(w, gathered[0]) for w in gathered)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # without Join: a group of its own with a short timeout, so the waiting ranks fail fast
    short = dist.new_group(timeout=datetime.timedelta(seconds=TIMEOUT_S))
    torch.manual_seed(0)
    plain = DDP(nn.Linear(4, 1), process_group=short)
    without = train(plain, rank)
    dist.barrier()                       # the default group: every rank is done with the first part
    torch.manual_seed(0)
    # with Join: a timeout too, ten times longer, so a Join that fails to answer fails, not hangs
    model = DDP(nn.Linear(4, 1), process_group=dist.new_group(timeout=datetime.timedelta(seconds=10 * TIMEOUT_S)))
    with model.join():                   # a rank out of batches answers the others' all-reduces
        joined = train(model, rank)
        inside = flat(model)             # this rank's weights as it ran out, still inside the with
    # leaving the with, Join copies the last rank to finish onto every rank (DDP's _sync_final_model)
    result = {"rank": rank, "world_size": world, "batches": 2 + rank, "timeout_s": TIMEOUT_S,
              "without_join": without, "with_join": joined,
              "weights_equal_inside": all_equal(inside, world),
              "weights_equal": all_equal(flat(model), world)}
    results = [None] * world
    dist.all_gather_object(results, result)
    if rank == 0:
        metrics.save_json("join.json", results)
    dist.destroy_process_group()
    os._exit(0)   # the timed-out group may hold a gloo thread: leave without waiting for it


if __name__ == "__main__":
    main()
