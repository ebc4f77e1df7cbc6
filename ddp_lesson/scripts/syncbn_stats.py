"""Check (lesson 04): SyncBatchNorm over N ranks of batch b == BatchNorm over the N*b batch.

Every rank builds the same global batch, feeds its own b samples through SyncBatchNorm and,
as the reference, the whole batch through a plain BatchNorm2d. Also times a DDP training
step of SmallCNN with BatchNorm vs SyncBatchNorm, side by side. Writes syncbn.json.
"""
import copy
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lesson import data, models, syncbn

B = int(sys.argv[1]) if len(sys.argv) > 1 else 4  # per-rank batch


def step_ms(model, x, y, steps=15):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return 1000 * (time.perf_counter() - t0) / steps


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    full = torch.randn(world * B, 8, 5, 5) * 3 + 1  # the same global batch on every rank
    mine = full[rank * B:(rank + 1) * B]

    bn = nn.BatchNorm2d(8)
    sync = syncbn.convert_sync_batchnorm(nn.Sequential(copy.deepcopy(bn)))[0]  # GPU: nn.SyncBatchNorm
    local = copy.deepcopy(bn)
    weights = torch.randn(world * B, 8, 5, 5, generator=torch.Generator().manual_seed(1))
    for _ in range(3):  # three training-mode passes update the running statistics
        mine_x, full_x = mine.clone().requires_grad_(), full.clone().requires_grad_()
        out_sync = sync(mine_x)
        out_local = local(mine)
        out_ref = bn(full_x)
    (out_sync * weights[rank * B:(rank + 1) * B]).sum().backward()  # backward sums over ranks too
    (out_ref * weights).sum().backward()
    agree = lambda a, b: torch.allclose(a, b, atol=1e-5)
    result = {
        "rank": rank, "per_rank_batch": B, "world_size": world,
        "sync_mean_matches_big_batch": agree(sync.running_mean, bn.running_mean),
        "sync_var_matches_big_batch": agree(sync.running_var, bn.running_var),
        "sync_output_matches_big_batch": agree(out_sync, out_ref[rank * B:(rank + 1) * B]),
        "sync_input_grad_matches_big_batch": agree(mine_x.grad, full_x.grad[rank * B:(rank + 1) * B]),
        "plain_bn_mean_matches_big_batch": agree(local.running_mean, bn.running_mean),
        "plain_bn_mean_abs_diff": (local.running_mean - bn.running_mean).abs().max().item(),
        "sync_mean_abs_diff": (sync.running_mean - bn.running_mean).abs().max().item(),
    }

    # Cost: one DDP step with BatchNorm vs SyncBatchNorm at this per-rank batch.
    x, y = data.shapes(B, seed=rank).tensors
    plain = DDP(models.SmallCNN())
    synced = DDP(syncbn.convert_sync_batchnorm(models.SmallCNN()))
    times = {"bn": [], "syncbn": []}
    for _ in range(3):
        times["bn"].append(step_ms(plain, x, y))
        times["syncbn"].append(step_ms(synced, x, y))
    result["ms_per_step_bn"] = min(times["bn"])
    result["ms_per_step_syncbn"] = min(times["syncbn"])

    results = [None] * world
    dist.all_gather_object(results, result)
    if rank == 0:
        with open(os.path.join(os.environ.get("DDP_LESSON_RUN_DIR", "."), "syncbn.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
