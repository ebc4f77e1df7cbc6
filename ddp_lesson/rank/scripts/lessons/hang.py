"""A collective that never completes: one rank skips an all_reduce that the others wait in.

    torchrun --standalone --nproc-per-node 2 hang.py            # hangs (until a timeout)
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun ... hang.py         # a clear error instead

The laggard is the last rank (rank 1 of 2).
--mode skip     it goes on to the next collective (a barrier): the ranks disagree on
                which collective comes next. DETAIL checks every collective against the
                other ranks first and reports the mismatch.
--mode sleep    it just never arrives (stuck in data loading, say); with one rank, that
                rank sleeps: a run that never ends by itself.
parse_args and run are apart from main so that another script can run this one after itself,
in the same ranks (ddp_lesson/rank/chain.py's --then; notebook 07 does, to save a launch).
"""
import argparse
import faulthandler
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

# `kill -USR2 <pid>` makes this process print every thread's Python stack to stderr, even while it
# waits inside a collective's C++ code; it goes on running (py-spy dump --pid <pid> shows the same)
faulthandler.register(signal.SIGUSR2, all_threads=True)  # (the course's guard uses SIGUSR1)


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="skip", choices=["skip", "sleep"])
    return p.parse_args(argv)


@record
def main():
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    run(args, device)
    dist.destroy_process_group()


def run(args, device):
    rank, laggard = dist.get_rank(), dist.get_world_size() - 1
    grad = torch.ones(4, device=device)
    dist.all_reduce(grad)  # every rank: fine
    print(f"rank {rank}: first all_reduce done", flush=True)
    if rank == laggard:
        if args.mode == "sleep":
            time.sleep(3600)
        # the bug: the laggard skips the second all_reduce (say, an `if` on a per-rank value)
    else:
        print(f"rank {rank}: waiting in the second all_reduce...", flush=True)
        dist.all_reduce(grad)
    dist.barrier()
    print(f"rank {rank}: never printed", flush=True)


if __name__ == "__main__":
    main()
