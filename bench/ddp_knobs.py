"""DDP's knobs measured side by side in one run: bucket_cap_mb, gradient_as_bucket_view,
static_graph.

    python bench/ddp_knobs.py [--nproc 2] [--quick] [--cpu]

One launch; every rank builds the same MLP (many equal Linear layers, so gradients fill
several buckets) and wraps it in DDP once per configuration. A communication hook counts
the all-reduce calls (one per bucket) and bytes of a step; the step time is the median of
timed steps. Printed per configuration: buckets per step, MB reduced per step, distinct
gradient storages (gradient_as_bucket_view makes .grad a view into the bucket, so there is
one storage per bucket instead of one per parameter and no copy), step time, and the ratio
to the default configuration. The measuring lives in ddp_lesson.rank.knobs (notebook 06 uses it too).
"""
import argparse
import os
import time
from pathlib import Path

from common import command_line  # bench/common.py
from ddp_lesson.rank import knobs
from ddp_lesson.launcher import launch, runs


def worker(argv):
    import torch
    import torch.distributed as dist
    from ddp_lesson.rank import metrics

    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local)
    else:
        torch.set_num_threads(1)
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    rows = knobs.measure_configs(device, quick=a.quick)
    if dist.get_rank() == 0:
        for i, r in enumerate(rows):
            metrics.log(i, kind="knobs", world_size=dist.get_world_size(), backend=dist.get_backend(), **r)
    dist.destroy_process_group()


def measure(nproc=2, quick=True, cpu=False, run_dir=None, timeout=300):
    run = launch.start(Path(__file__), nproc=nproc, cpu=cpu, run_dir=run_dir, timeout=timeout,
                       label="ddp_knobs", env={"OMP_NUM_THREADS": 1},
                       args=["--worker"] + (["--quick"] if quick else []))
    res = run.wait()
    if res["status"] != "ok":
        raise RuntimeError(f"knobs run {res['status']}: {res.get('message')}")
    return [r for r in runs.load(run.run_dir).rows if r.get("kind") == "knobs"]


def main(argv=None):
    a = command_line(__doc__, worker, "small model, few steps (CI)", argv)
    if a is None:
        return 0
    t = time.perf_counter()
    knobs.report(measure(nproc=a.nproc, quick=a.quick, cpu=a.cpu))
    print(f"{time.perf_counter() - t:.1f} s in all (timings on a shared machine are noisy)")


if __name__ == "__main__":
    main()
