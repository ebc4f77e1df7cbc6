"""Notebook 09's checks in one torchrun run, for tests/test_lesson_09.py (one start-up for all):
the ring all-reduce against dist.all_reduce (ring_allreduce.check, as the notebook's section 2
runs it), stages (a)-(c) of DDP from scratch, and stage (d) once per --bucketed NAME=FILE,
each beside torch DDP through ddp_scratch.check_stage, the function ddp_scratch.py's own main
runs, and DDP's collectives counted per phase (ddp_collectives.count_ddp, as section 6 runs it)
beside the rule's counts. Rank 0 writes cases.json: world_size, ring (rows per rank), stages,
bucketed (by NAME), collectives ({"counted": per rank, "expected": the rule})."""
import argparse
import json
import os

import torch
import torch.distributed as dist

from ddp_lesson.rank import data, models
from ddp_lesson.notebook.lesson import load_script, script

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=2, help="2: step 1 on DDP's one bucket, step 2 on its rebuilt ones")
p.add_argument("--bucket-kb", type=float, default=8)
p.add_argument("--bucketed", action="append", default=[], metavar="NAME=FILE")
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
ring = load_script(script("ring_allreduce.py")).check(sizes=(1, 3, 7, 1000, 1001, 4096 * world + 1))
ddp_scratch = load_script(script("ddp_scratch.py"))
torch.manual_seed(rank)                    # different initial weights on every rank, as ddp_scratch.py
base = models.SmallCNN(norm=False)
x, y = data.shapes(16 * args.steps, seed=100 + rank).tensors
batches = list(zip(x.chunk(args.steps), y.chunk(args.steps)))
bucket_bytes = int(args.bucket_kb * 1024)
out = {"world_size": world, "parameters": len(list(base.parameters())), "stages": {}, "bucketed": {}}
for stage in "abc":
    out["stages"][stage] = ddp_scratch.check_stage(stage, base, batches, bucket_bytes, None)
for name, path in (a.split("=", 1) for a in args.bucketed):
    out["bucketed"][name] = ddp_scratch.check_stage("d", base, batches, bucket_bytes, ddp_scratch.load_bucketed(path))
rows = [None] * world
dist.all_gather_object(rows, ring)
out["ring"] = rows
ddp_collectives = load_script(script("ddp_collectives.py"))
counted, expected = {}, {}
for name, batchnorm, options in [("BatchNorm", True, {}), ("no buffers", False, {}),
                                 ("find_unused_parameters=True", False, {"find_unused_parameters": True})]:
    torch.manual_seed(rank)
    model = ddp_collectives.tiny_net(batchnorm)
    cap = min(p.numel() * p.element_size() for p in model.parameters())
    expected[name] = ddp_collectives.expected_counts(model, buckets=len(list(model.parameters())), **options)
    counted[name] = ddp_collectives.count_ddp(model, bucket_cap_mb=cap / 2 ** 20, **options)
per_rank = [None] * world
dist.all_gather_object(per_rank, counted)
out["collectives"] = {"counted": per_rank, "expected": expected}
if rank == 0:
    with open(os.path.join(os.environ["DDP_LESSON_RUN_DIR"], "cases.json"), "w") as f:
        json.dump(out, f, indent=1)
dist.destroy_process_group()
