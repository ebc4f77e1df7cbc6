"""Rank 1 raises after the process group is up; rank 0 waits in a collective that never
completes. A plain script: no @record, so the launcher's guard must report the error
(with --record the entry point uses torch's @record, as the reference scripts do)."""
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def explode():
    raise ValueError("boom from rank 1")


def main():
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        explode()
    t = torch.ones(1)
    dist.all_reduce(t)  # never completes: rank 1 is gone
    print("rank 0 should not get here", flush=True)


if __name__ == "__main__":
    (record(main) if "--record" in sys.argv else main)()
