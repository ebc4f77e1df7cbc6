"""DDP's knobs measured side by side on the ranks of one launch: bucket_cap_mb,
gradient_as_bucket_view, static_graph (notebook 06, bench/ddp_knobs.py).

Every rank builds the same MLP (many equal Linear layers, so gradients fill several
buckets) and wraps it in DDP once per configuration. A communication hook counts the
all-reduce calls (one per bucket) and bytes of a step; the step time is the median of timed
steps. gradient_as_bucket_view makes .grad a view into the bucket: one gradient storage per
bucket instead of one per parameter, and no copy.
"""
import statistics
import sys
import time

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


def report(rows, out=sys.stdout):
    r0 = rows[0]
    n = r0["world_size"]
    print(f"DDP knobs on {n} rank{'s' if n != 1 else ''} ({r0['backend']}), MLP with {r0['params']} parameter tensors, "
          f"{r0['param_bytes'] / 2**20:.2f} MiB of gradients:", file=out)
    print(f"{'configuration':<36} {'buckets':>7} {'MB/step':>8} {'grad storages':>13} {'step':>9} {'vs default':>10}",
          file=out)
    for r in rows:
        print(f"{r['config']:<36} {r['buckets_per_step']:7.1f} {r['bytes_per_step'] / 1e6:8.2f} "
              f"{r['grad_storages']:>13} {r['step_s'] * 1e3:7.2f}ms {r['step_s'] / r0['step_s']:9.2f}x", file=out)
    by = {r["config"]: r for r in rows}
    small, big = by["bucket_cap_mb=0.25"], by["bucket_cap_mb=100"]
    print(f"ratio: buckets at 0.25 MB / at 100 MB = {small['buckets_per_step']:.0f} / {big['buckets_per_step']:.0f}; "
          f"step time {small['step_s'] / big['step_s']:.2f}x (on a shared machine: noise unless a rerun repeats it)", file=out)
    print(f"ratio: grad storages without / with gradient_as_bucket_view = "
          f"{r0['grad_storages']} / {by['gradient_as_bucket_view=True']['grad_storages']}", file=out)
