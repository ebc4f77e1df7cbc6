"""All-reduce time and bandwidth vs message size, measured in one run.

    python bench/allreduce_bandwidth.py [--nproc 2] [--quick] [--cpu]

Starts `nproc` ranks with the ddp_lesson launcher (gloo on CPU, nccl on GPUs). For each
message size every rank times `iters` all_reduce calls (the slowest rank's time counts).
Prints, per size: time, algorithm bandwidth (bytes / time) and bus bandwidth
(algbw * 2(n-1)/n, what a ring moves over each link; comparable across rank counts),
then the fit  t(bytes) = alpha + bytes / beta  (latency alpha, bandwidth beta) and the
ratio of large-message to small-message bandwidth. Small messages are latency-bound: that
is why DDP packs gradients into buckets instead of reducing each tensor alone.
"""
import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
QUICK_SIZES = [2 ** k for k in range(10, 23, 2)]   # 1 KiB .. 4 MiB
FULL_SIZES = [2 ** k for k in range(8, 27)]          # 256 B .. 64 MiB


# -- rank side -------------------------------------------------------------------------
def sweep(sizes, iters=10, warmup=2, device=None):
    """[(bytes, seconds per all_reduce)] on this rank; the max over ranks is returned
    (a collective is as slow as its slowest member). Needs an initialised process group."""
    import torch
    import torch.distributed as dist

    device = device or torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = []
    for nbytes in sizes:
        x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        n = iters if nbytes <= 2 ** 22 else max(2, iters // 4)
        for _ in range(warmup):
            dist.all_reduce(x)
        sync()
        dist.barrier()
        t = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(x)
        sync()
        dt = torch.tensor([(time.perf_counter() - t) / n], dtype=torch.float64, device=device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        out.append((x.numel() * 4, dt.item()))
    return out


def worker(argv):
    import torch
    import torch.distributed as dist
    from ddp_lesson import metrics

    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default=",".join(map(str, QUICK_SIZES)))
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args(argv)
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    rows = sweep([int(s) for s in a.sizes.split(",")], iters=a.iters, device=device)
    if dist.get_rank() == 0:
        for i, (nbytes, sec) in enumerate(rows):
            metrics.log(i, bytes=nbytes, seconds=sec, world_size=dist.get_world_size(),
                        backend=dist.get_backend())
    dist.destroy_process_group()


# -- driver side -----------------------------------------------------------------------
def bandwidths(nbytes, seconds, world):
    algbw = nbytes / seconds
    return algbw, algbw * 2 * (world - 1) / world


def fit(rows):
    """alpha (s) and beta (bytes/s) of t = alpha + bytes/beta, least squares on the
    relative error (so 1 KiB counts as much as 64 MiB)."""
    # minimise sum(((alpha + x*g) - y) / y)^2 over alpha and g = 1/beta: 2x2 normal equations
    s11 = s12 = s22 = b1 = b2 = 0.0
    for r in rows:
        x, y = r["bytes"], r["seconds"]
        w = 1.0 / (y * y)
        s11 += w; s12 += w * x; s22 += w * x * x; b1 += w * y; b2 += w * x * y
    det = s11 * s22 - s12 * s12
    alpha = (b1 * s22 - b2 * s12) / det
    g = (s11 * b2 - s12 * b1) / det
    if alpha <= 0:
        alpha = min(r["seconds"] for r in rows) / 2
    return alpha, (1 / g if g > 0 else float("inf"))


def predict_seconds(nbytes, alpha, beta):
    return alpha + nbytes / beta


def measure(nproc=2, quick=True, sizes=None, iters=None, cpu=False, run_dir=None, timeout=300):
    """Launch the sweep; returns {"rows": [...], "alpha": s, "beta": bytes/s, "world": n, ...}."""
    sys.path.insert(0, str(HERE.parent))
    from ddp_lesson import launch, runs

    sizes = sizes or (QUICK_SIZES if quick else FULL_SIZES)
    iters = iters or (6 if quick else 20)
    run = launch.start(Path(__file__), nproc=nproc, cpu=cpu, run_dir=run_dir, timeout=timeout,
                       label="allreduce_bandwidth",
                       args=["--worker", "--sizes", ",".join(map(str, sizes)), "--iters", str(iters)])
    res = run.wait()
    if res["status"] != "ok":
        raise RuntimeError(f"all-reduce sweep {res['status']}: {res.get('message')}")
    rows = [r for r in runs.load(run.run_dir).rows if "bytes" in r]
    world = rows[0]["world_size"]
    for r in rows:
        r["algbw"], r["busbw"] = bandwidths(r["bytes"], r["seconds"], world)
    alpha, beta = fit(rows)
    return {"rows": rows, "alpha": alpha, "beta": beta, "world": world,
            "backend": rows[0]["backend"], "run_dir": str(run.run_dir)}


def human(nbytes):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.3g} {unit}"
        nbytes /= 1024


def report(m, out=sys.stdout):
    print(f"all_reduce on {m['world']} ranks ({m['backend']}):", file=out)
    print(f"{'size':>10} {'time':>10} {'algbw':>12} {'busbw':>12} {'fit':>10}", file=out)
    for r in m["rows"]:
        print(f"{human(r['bytes']):>10} {r['seconds'] * 1e6:8.0f}us {r['algbw'] / 1e6:8.1f}MB/s "
              f"{r['busbw'] / 1e6:8.1f}MB/s {predict_seconds(r['bytes'], m['alpha'], m['beta']) * 1e6:8.0f}us",
              file=out)
    small, large = m["rows"][0], m["rows"][-1]
    print(f"fit: latency alpha = {m['alpha'] * 1e6:.0f} us, bandwidth beta = {m['beta'] / 1e6:.0f} MB/s", file=out)
    print(f"ratio: busbw at {human(large['bytes'])} / busbw at {human(small['bytes'])} = "
          f"{large['busbw'] / small['busbw']:.0f}x (small messages are latency-bound)", file=out)
    print(f"ratio: time at {human(large['bytes'])} / time at {human(small['bytes'])} = "
          f"{large['seconds'] / small['seconds']:.1f}x for {large['bytes'] / small['bytes']:.0f}x the bytes", file=out)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="fewer sizes and iterations (CI)")
    p.add_argument("--cpu", action="store_true", help="CPU ranks on gloo even where GPUs exist")
    a = p.parse_args(argv)
    t = time.perf_counter()
    m = measure(nproc=a.nproc, quick=a.quick, cpu=a.cpu)
    report(m)
    print(f"run directory {m['run_dir']}; {time.perf_counter() - t:.1f} s in all")


if __name__ == "__main__":
    main()
