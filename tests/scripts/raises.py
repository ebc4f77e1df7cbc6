"""Rank 1 raises after the process group is up; rank 0 waits in a collective that never
completes. A plain script: no @record, so the launcher's guard must report the error."""
import torch
import torch.distributed as dist


def explode():
    raise ValueError("boom from rank 1")


dist.init_process_group("gloo")
if dist.get_rank() == 1:
    explode()
t = torch.ones(1)
dist.all_reduce(t)  # never completes: rank 1 is gone
print("rank 0 should not get here", flush=True)
