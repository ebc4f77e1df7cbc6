"""GPU check (tools/gpu_check.sh): all_reduce on every rank's GPU, correct and timed.

Every rank contributes rank+1 (the sum must be n(n+1)/2), then a 64 MiB float32 tensor is
all-reduced 10 times; rank 0 writes nccl.json with the backend, NCCL's version, the
algorithm bandwidth (bytes / time) and the bus bandwidth (x 2(n-1)/n, what a ring moves).
Runs on CPU ranks (gloo) too, so its logic is tested without a GPU.
"""
import json
import os
import time

import torch
import torch.distributed as dist

from ddp_lesson.rank import metrics

MIB = 64


def main():
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    sync = torch.cuda.synchronize if use_cuda else (lambda: None)

    t = torch.tensor([rank + 1.0], device=device)
    dist.all_reduce(t)
    correct = t.item() == n * (n + 1) / 2

    big = torch.ones(MIB * 2**20 // 4, device=device)
    dist.all_reduce(big)  # warm-up (and NCCL's communicator set-up)
    sync()
    reps = 10
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(big)
    sync()
    seconds = (time.perf_counter() - t0) / reps
    algbw = MIB * 2**20 / seconds / 1e9
    names = [None] * n
    dist.all_gather_object(names, torch.cuda.get_device_name(local_rank) if use_cuda else "cpu")
    if rank == 0:
        result = {"world_size": n, "backend": dist.get_backend(), "devices": names,
                  "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if use_cuda else None,
                  "sum_correct": correct, "message_mib": MIB, "ms_per_all_reduce": 1000 * seconds,
                  "algbw_gb_s": algbw, "busbw_gb_s": algbw * 2 * (n - 1) / n}
        metrics.save_json("nccl.json", result)
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()
    if not correct:
        raise SystemExit(f"all_reduce gave {t.item()}, expected {n * (n + 1) / 2}")


if __name__ == "__main__":
    main()
