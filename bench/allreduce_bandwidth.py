"""All-reduce time and bandwidth vs message size, measured in one run.

    python bench/allreduce_bandwidth.py [--nproc 2] [--quick] [--cpu]

Starts `nproc` ranks with the ddp_lesson launcher (gloo on CPU, nccl on GPUs). For each
message size every rank times `iters` all_reduce calls (the slowest rank's time counts).
Prints, per size: time, algorithm bandwidth (bytes / time) and bus bandwidth
(algbw * 2(n-1)/n, what a ring moves over each link; comparable across rank counts),
then the fit  t(bytes) = alpha + bytes / beta  (latency alpha, bandwidth beta) and the
ratio of large-message to small-message bandwidth. Small messages are latency-bound: that
is why DDP packs gradients into buckets instead of reducing each tensor alone.
The sweep and the fit live in ddp_lesson.rank.costmodel (notebook 06 uses them too).
"""
import argparse
import os
import time
from pathlib import Path

from common import command_line  # bench/common.py
from ddp_lesson.rank import costmodel
from ddp_lesson.launcher import launch, runs


def worker(argv):
    import torch
    import torch.distributed as dist
    from ddp_lesson.rank import metrics

    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default=",".join(map(str, costmodel.QUICK_SIZES)))
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args(argv)
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    rows = costmodel.sweep([int(s) for s in a.sizes.split(",")], iters=a.iters, device=device)
    if dist.get_rank() == 0:
        for i, (nbytes, sec) in enumerate(rows):
            metrics.log(i, bytes=nbytes, seconds=sec, world_size=dist.get_world_size(),
                        backend=dist.get_backend())
    dist.destroy_process_group()


def measure(nproc=2, quick=True, sizes=None, iters=None, cpu=False, run_dir=None, timeout=300):
    """Launch the sweep; returns costmodel.summarise's dict plus "run_dir"."""
    sizes = sizes or (costmodel.QUICK_SIZES if quick else costmodel.FULL_SIZES)
    iters = iters or (6 if quick else 20)
    run = launch.start(Path(__file__), nproc=nproc, cpu=cpu, run_dir=run_dir, timeout=timeout,
                       label="allreduce_bandwidth",
                       args=["--worker", "--sizes", ",".join(map(str, sizes)), "--iters", str(iters)])
    res = run.wait()
    if res["status"] != "ok":
        raise RuntimeError(f"all-reduce sweep {res['status']}: {res.get('message')}")
    rows = [r for r in runs.load(run.run_dir).rows if "bytes" in r]
    return dict(costmodel.summarise(rows, rows[0]["world_size"]), run_dir=str(run.run_dir))


def main(argv=None):
    a = command_line(__doc__, worker, "fewer sizes and iterations (CI)", argv)
    if a is None:
        return 0
    t = time.perf_counter()
    m = measure(nproc=a.nproc, quick=a.quick, cpu=a.cpu)
    costmodel.report(m)
    print(f"run directory {m['run_dir']}; {time.perf_counter() - t:.1f} s in all")


if __name__ == "__main__":
    main()
