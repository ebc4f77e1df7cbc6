"""DDP's knobs measured side by side in one run: bucket_cap_mb, gradient_as_bucket_view,
static_graph.

    python bench/ddp_knobs.py [--nproc 2] [--quick] [--cpu]

One launch; every rank builds the same MLP (many equal Linear layers, so gradients fill
several buckets) and wraps it in DDP once per configuration. A communication hook counts
the all-reduce calls (one per bucket) and bytes of a step; the step time is the median of
timed steps. Printed per configuration: buckets per step, MB reduced per step, distinct
gradient storages (gradient_as_bucket_view makes .grad a view into the bucket, so there is
one storage per bucket instead of one per parameter and no copy), step time, and the ratio
to the default configuration.
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

CONFIGS = [
    ("default (25 MB, no view, dynamic)", dict()),
    ("bucket_cap_mb=0.25", dict(bucket_cap_mb=0.25)),
    ("bucket_cap_mb=100", dict(bucket_cap_mb=100)),
    ("gradient_as_bucket_view=True", dict(gradient_as_bucket_view=True)),
    ("static_graph=True", dict(static_graph=True)),
]


def measure_configs(device, quick=True, width=None, layers=None, batch=32, steps=None):
    """Run every configuration on this rank; returns a list of dicts (same on all ranks
    except timings, which are the max over ranks). Needs an initialised process group."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    width = width or (256 if quick else 1024)
    layers = layers or (6 if quick else 8)
    steps = steps or (8 if quick else 30)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    base = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])
    x = torch.randn(batch, width, device=device)

    def counting_hook(state, bucket):
        state["calls"] += 1
        buf = bucket.buffer()
        state["bytes"] += buf.numel() * buf.element_size()
        return default_hooks.allreduce_hook(None, bucket)

    out = []
    for name, kw in CONFIGS:
        model = nn.Sequential(*[type(m)(width, width) if isinstance(m, nn.Linear) else nn.ReLU() for m in base])
        model.load_state_dict(base.state_dict())
        model = model.to(device)
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **kw)
        state = {"calls": 0, "bytes": 0}
        ddp.register_comm_hook(state, counting_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)

        def step():
            opt.zero_grad(set_to_none=not kw.get("gradient_as_bucket_view", False))
            ddp(x).square().mean().backward()
            opt.step()

        for _ in range(3):  # buckets are rebuilt after the first iteration; static graph settles
            step()
        sync()
        state.update(calls=0, bytes=0)
        times = []
        for _ in range(steps):
            dist.barrier()
            t = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t)
        params = [p for p in ddp.parameters()]
        storages = len({p.grad.untyped_storage().data_ptr() for p in params})
        t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out.append({"config": name, "kwargs": kw, "buckets_per_step": state["calls"] / steps,
                    "bytes_per_step": state["bytes"] / steps, "grad_storages": storages,
                    "params": len(params), "step_s": t.item(),
                    "param_bytes": sum(p.numel() * p.element_size() for p in params)})
        del ddp, opt, model
    return out


def worker(argv):
    import torch
    import torch.distributed as dist
    from ddp_lesson import metrics

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
    rows = measure_configs(device, quick=a.quick)
    if dist.get_rank() == 0:
        for i, r in enumerate(rows):
            metrics.log(i, kind="knobs", world_size=dist.get_world_size(), backend=dist.get_backend(), **r)
    dist.destroy_process_group()


def measure(nproc=2, quick=True, cpu=False, run_dir=None, timeout=300):
    sys.path.insert(0, str(HERE.parent))
    from ddp_lesson import launch, runs
    run = launch.start(Path(__file__), nproc=nproc, cpu=cpu, run_dir=run_dir, timeout=timeout,
                       label="ddp_knobs", env={"OMP_NUM_THREADS": 1},
                       args=["--worker"] + (["--quick"] if quick else []))
    res = run.wait()
    if res["status"] != "ok":
        raise RuntimeError(f"knobs run {res['status']}: {res.get('message')}")
    return [r for r in runs.load(run.run_dir).rows if r.get("kind") == "knobs"]


def report(rows, out=sys.stdout):
    r0 = rows[0]
    print(f"DDP knobs on {r0['world_size']} ranks ({r0['backend']}), MLP with {r0['params']} parameter tensors, "
          f"{r0['param_bytes'] / 2**20:.2f} MiB of gradients:", file=out)
    print(f"{'configuration':<36} {'buckets':>7} {'MB/step':>8} {'grad storages':>13} {'step':>9} {'vs default':>10}",
          file=out)
    for r in rows:
        print(f"{r['config']:<36} {r['buckets_per_step']:7.1f} {r['bytes_per_step'] / 1e6:8.2f} "
              f"{r['grad_storages']:>13} {r['step_s'] * 1e3:7.2f}ms {r['step_s'] / r0['step_s']:9.2f}x", file=out)
    by = {r["config"]: r for r in rows}
    small, big = by["bucket_cap_mb=0.25"], by["bucket_cap_mb=100"]
    print(f"ratio: buckets at 0.25 MB / at 100 MB = {small['buckets_per_step']:.0f} / {big['buckets_per_step']:.0f}; "
          f"step time {small['step_s'] / big['step_s']:.2f}x", file=out)
    print(f"ratio: grad storages without / with gradient_as_bucket_view = "
          f"{r0['grad_storages']} / {by['gradient_as_bucket_view=True']['grad_storages']}", file=out)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="small model, few steps (CI)")
    p.add_argument("--cpu", action="store_true", help="CPU ranks on gloo even where GPUs exist")
    a = p.parse_args(argv)
    t = time.perf_counter()
    report(measure(nproc=a.nproc, quick=a.quick, cpu=a.cpu))
    print(f"{time.perf_counter() - t:.1f} s in all (timings on a shared machine are noisy)")


if __name__ == "__main__":
    main()
