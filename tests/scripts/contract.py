"""Writes metrics, prints its environment, then (with --gate PATH) waits until PATH
exists before finishing, so a test can read metrics while the run is still going.
Uses ddp_lesson.rank.metrics, and must also run under plain torchrun
(no launcher, no DDP_LESSON_RUN_DIR)."""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from ddp_lesson.rank import metrics

p = argparse.ArgumentParser()
p.add_argument("--gate", default="")
p.add_argument("--steps", type=int, default=3)
args = p.parse_args()

dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
for step in range(args.steps):
    loss = torch.tensor(float(rank + step))
    dist.all_reduce(loss)   # the mean over ranks, for the log only
    metrics.log(step, loss=loss / world_size, test_accuracy=0.5 + 0.1 * step)
if rank == 0:
    print(f"world size {world_size}", flush=True)
print("env " + json.dumps({k: os.environ.get(k) for k in
                           ("RANK", "DDP_LESSON_RUN_DIR", "MASTER_PORT", "WORLD_SIZE")}), flush=True)
if args.gate:
    deadline = time.time() + 60
    while not os.path.exists(args.gate) and time.time() < deadline:
        time.sleep(0.05)
metrics.log(args.steps, loss=0.0, test_accuracy=1.0)
dist.barrier()
dist.destroy_process_group()
import os, sys; sys.stdout.flush(); sys.stderr.flush()
os._exit(0)  # skip finalization: it races gloo's worker thread and can abort (SIGABRT); see guard._exit_rank
