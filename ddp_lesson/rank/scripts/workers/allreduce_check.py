"""doctor's smoke test: every rank contributes rank+1; the sum must be n(n+1)/2."""
import os

import torch
import torch.distributed as dist

from ddp_lesson.rank import metrics

use_cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if use_cuda else "gloo")
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if use_cuda else torch.device("cpu")
if use_cuda:
    torch.cuda.set_device(device)
n, rank = dist.get_world_size(), dist.get_rank()
t = torch.tensor([rank + 1.0], device=device)
dist.all_reduce(t)
assert t.item() == n * (n + 1) / 2, f"all_reduce gave {t.item()}, expected {n * (n + 1) / 2}"
if rank == 0:
    said = f"all_reduce over {n} ranks on {dist.get_backend()}: {t.item():g} (correct)"
    print(said)
    metrics.save_json("allreduce.json", {"said": said})   # doctor reads this, not the log
dist.destroy_process_group()
