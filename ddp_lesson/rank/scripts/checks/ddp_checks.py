"""Check (notebook 03b): three things DDP does that a learner cannot see, measured.

1. The all-reduce overlaps backward: a comm hook stamps when each gradient bucket's
   all-reduce is launched and when it finishes, a tensor hook stamps when the FIRST layer's
   gradient (the last one backward computes) is ready. With small buckets the first
   all-reduce starts before backward is done; with one bucket for the whole model it cannot.
   (The first iteration always uses one bucket; DDP rebuilds the buckets at the second
   forward, so we time the third backward.) The hook also records which parameters each
   bucket holds (GradBucket.parameters()), in the first backward and the third.
2. Buffers are broadcast: BatchNorm's running statistics drift apart on ranks that see
   different data; with forward_sync_buffers=True (the default) a training forward that
   follows a synced training forward starts from rank 0's buffers, with False each rank keeps
   its own. A forward under torch.no_grad() turns the next forward's broadcast off.
3. map_location: a checkpoint rank 0 saved records rank 0's device; loading it with
   map_location=<this rank's device> puts every tensor on this rank's own device. On CPU ranks
   both devices are cpu, with or without map_location: the result means something on GPUs only.
Writes ddp_checks.json (one entry per rank) into the run directory (check() does the work;
notebook 03b runs it with ddp_equivalence.py and find_unused.py in one launch, checks_03b.py).
"""
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lesson.rank import metrics


def overlap(device, ids, bucket_cap_mb):
    torch.manual_seed(0)
    layers = [nn.Linear(512, 512) for _ in range(8)]  # 1 MiB of weights each
    model = DDP(nn.Sequential(*layers).to(device), device_ids=ids, bucket_cap_mb=bucket_cap_mb)
    names = {p: n for n, p in model.module.named_parameters()}
    stamps = {"launch": {}, "done": {}, "first_layer_grad": None, "params": {}}

    def hook(state, bucket):  # state: what register_comm_hook was given (None here)
        i = bucket.index()    # buckets may finish out of order: key the stamps by bucket
        stamps["launch"][i] = time.perf_counter()
        stamps["params"][i] = [names[p] for p in bucket.parameters()]  # which parameters it holds
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()

        def finished(f):
            stamps["done"][i] = time.perf_counter()
            return f.value()[0] / dist.get_world_size()
        return fut.then(finished)

    model.register_comm_hook(None, hook)
    layers[0].weight.register_hook(
        lambda g: stamps.__setitem__("first_layer_grad", time.perf_counter()))
    x = torch.randn(64, 512, device=device)
    first_buckets = None
    for _ in range(3):  # the first step builds the buckets; time the last one
        stamps["launch"].clear()
        stamps["done"].clear()
        model.zero_grad()
        loss = model(x).square().mean()
        start = time.perf_counter()
        loss.backward()
        if first_buckets is None:  # the first backward's buckets, before DDP rebuilds them
            first_buckets = [stamps["params"][i] for i in sorted(stamps["params"])]
    order = sorted(stamps["launch"], key=stamps["launch"].get)  # bucket indices, by launch time
    lead_ms = 1000 * (stamps["first_layer_grad"] - stamps["launch"][order[0]])
    # for a picture: seconds since backward started (the last layer's bucket comes first)
    timeline = {"backward_end": stamps["first_layer_grad"] - start,
                "all_reduces": [[stamps["launch"][i] - start, stamps["done"][i] - start] for i in order]}
    return {"buckets": len(stamps["launch"]), "first_all_reduce_before_backward_done_ms": lead_ms,
            "timeline": timeline, "params": list(names.values()),  # in registration order
            "bucket_params": [stamps["params"][i] for i in sorted(stamps["params"])],
            "first_step_bucket_params": first_buckets}


def buffers_broadcast(device, ids, rank, world, sync, no_grad_before_last=False):
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4).to(device)
    seen = []
    bn.register_forward_pre_hook(lambda m, inp: seen.append(m.running_mean.clone()))
    # forward_sync_buffers replaces broadcast_buffers (deprecated since torch 2.13)
    model = DDP(nn.Sequential(bn), device_ids=ids, forward_sync_buffers=sync)
    for step in range(3):  # each rank's data has a different mean: rank + step
        x = torch.randn(16, 4, device=device) + rank + step
        if no_grad_before_last and step == 1:
            with torch.no_grad():  # still train mode: BN updates its buffers here
                model(x)
        else:
            model(x).sum().backward()
    start = seen[-1]  # the running mean this rank's last forward started from
    gathered = [torch.zeros_like(start) for _ in range(world)]
    dist.all_gather(gathered, start)
    return all(torch.equal(g, gathered[0]) for g in gathered)


BUFFER_FORWARDS = ["train"] * 3 + ["eval"] * 3 + ["train"] * 2   # training, an evaluation, training again


def buffer_copies(device, ids, rank, world):
    """The buffer rule, forward by forward: before each forward every rank sets its BatchNorm
    running mean to its own rank; at the start of BN's forward, after DDP's copy if any, the
    ranks compare it. Equal on every rank: rank 0's buffers were copied. Also logs DDP's own
    decision, will_sync_module_buffers(), read before each forward (one rank has nothing to
    compare, so there only the decision is known)."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4).to(device)
    seen = []
    bn.register_forward_pre_hook(lambda m, inp: seen.append(m.running_mean.clone()))
    model = DDP(nn.Sequential(bn), device_ids=ids)   # forward_sync_buffers=True, the default
    out = []
    for kind in BUFFER_FORWARDS:
        with torch.no_grad():
            bn.running_mean.fill_(float(rank))            # a different buffer on every rank
        decided = model.will_sync_module_buffers()        # DDP's decision for this forward
        x = torch.randn(8, 4, device=device)
        if kind == "eval":
            model.eval()
            with torch.no_grad():
                model(x)
            model.train()
        else:
            model(x).sum().backward()
        gathered = [torch.zeros_like(seen[-1]) for _ in range(world)]
        dist.all_gather(gathered, seen[-1])
        copied = all(torch.equal(g, gathered[0]) for g in gathered) if world > 1 else None
        out.append({"kind": kind, "decided": decided, "copied": copied})
    return out


def map_location(device, rank):
    path = metrics.run_dir() / "ddp_checks_ckpt.pt"
    if rank == 0:
        torch.save(nn.Linear(3, 3).to(device).state_dict(), path)
    dist.barrier()
    saved_on = set()
    torch.load(path, map_location=lambda storage, loc: saved_on.add(loc) or storage, weights_only=True)
    state = torch.load(path, map_location=device, weights_only=True)
    dist.barrier()
    return {"saved_on": sorted(saved_on), "loaded_on": sorted({str(t.device) for t in state.values()})}


def check(device, ids):
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {
        "rank": rank, "world_size": world, "device": str(device),
        "overlap_small_buckets": overlap(device, ids, bucket_cap_mb=1),
        "overlap_one_bucket": overlap(device, ids, bucket_cap_mb=1000),
        "buffers_equal_with_broadcast": buffers_broadcast(device, ids, rank, world, True),
        "buffers_equal_without_broadcast": buffers_broadcast(device, ids, rank, world, False),
        "buffers_equal_after_no_grad_forward": buffers_broadcast(device, ids, rank, world, True,
                                                                 no_grad_before_last=True),
        "map_location": map_location(device, rank),
        "buffer_copies": buffer_copies(device, ids, rank, world),
    }
    results = [None] * world
    dist.all_gather_object(results, result)
    if rank == 0:
        metrics.save_json("ddp_checks.json", results)


def main():
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    check(device, [local_rank] if use_cuda else None)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
