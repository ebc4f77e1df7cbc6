"""Speed-up and efficiency vs number of ranks, with the time of a step split into compute
and all-reduce, and a two-term model that predicts the speed-up; all measured in one run.

    python bench/scaling.py [--nprocs 1,2,4] [--quick] [--cpu]

One launch per rank count. Every rank trains SmallCNN on the built-in `shapes` data with
a fixed per-rank batch, so an epoch of the same data takes 1/n of the steps on n ranks
(the setting of the seeds' s/epoch figures). In each launch rank 0 reports:
- epoch_s    one real DDP epoch (after a warm-up);
- compute_s  a step with the all-reduce switched off (`no_sync`): forward, backward, step;
- compute_max_s  the same, per step the slowest rank's time (median over steps);
- allreduce_s one all_reduce of a flat tensor as large as all gradients;
- step_s     epoch_s / steps, a full DDP step.
Model:  step(n) = compute_max(n) + allreduce(n)  (no overlap assumed, so an upper bound),
        compute_max = per step, the slowest rank's compute (every rank waits for it);
        speed-up(n) = n * step(1) / step(n)   (each rank does 1/n of the steps).
The measured speed-up uses the median step of the real epoch the same way.
On CPU each rank is given one thread (one rank = one core, like one GPU), so 4 ranks on 2
cores are oversubscribed: compute(n) grows, and the model sees it because it is measured.
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# The seeds' measurements. WZ (ResNet-34, flower_photos, batch 16, Tesla V100): s/epoch on
# 1, 2, 4, 8 GPUs. The 3090 post: roberta-large, 1029 s on one card, 707 s on two.
SEED_WZ_S_PER_EPOCH = {1: 9.0, 2: 5.5, 4: 3.0, 8: 2.0}
SEED_3090_S = {1: 1029.0, 2: 707.0}


def seed_speedups():
    wz = {n: SEED_WZ_S_PER_EPOCH[1] / t for n, t in SEED_WZ_S_PER_EPOCH.items()}
    return {"wz_v100": wz, "3090": {n: SEED_3090_S[1] / t for n, t in SEED_3090_S.items()}}


# -- rank side -------------------------------------------------------------------------
def worker(argv):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from ddp_lesson import data, metrics, models

    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--compute-steps", type=int, default=8)
    p.add_argument("--extras", action="store_true", help="also run the all-reduce sweep and the DDP knobs")
    a = p.parse_args(argv)

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        torch.set_num_threads(1)  # one rank = one core
        device = torch.device("cpu")
    sync = torch.cuda.synchronize if use_cuda else (lambda: None)

    torch.manual_seed(0)
    train = data.shapes(a.samples, seed=0)
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=a.batch_size, sampler=sampler, drop_last=True)
    model = DDP(models.SmallCNN(width=a.width).to(device), device_ids=[local] if use_cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batches = [(x.to(device), y.to(device)) for x, y in loader]

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for x, y in batches[:3]:  # warm-up (first-iteration bucket rebuild, allocator)
        step(x, y)
    # compute only: the same step with the gradient all-reduce switched off
    def timed(fn, n):
        times = []
        for i in range(n):
            sync()
            t = time.perf_counter()
            fn(i)
            sync()
            times.append(time.perf_counter() - t)
        return times

    sync(); dist.barrier()
    with model.no_sync():
        ctimes = timed(lambda i: step(*batches[i % len(batches)]), a.compute_steps)
    compute_s = statistics.median(ctimes)
    # in a synchronised step everyone waits for the slowest rank: per step, the max over ranks
    every = [torch.zeros(len(ctimes), dtype=torch.float64, device=device) for _ in range(world)]
    dist.all_gather(every, torch.tensor(ctimes, dtype=torch.float64, device=device))
    compute_max_s = statistics.median(torch.stack(every).max(0).values.tolist())
    # the all-reduce alone: one flat tensor as large as all the gradients
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    flat = torch.zeros(nbytes // 4, device=device)
    dist.all_reduce(flat)
    dist.barrier()
    allreduce_s = statistics.median(timed(lambda i: dist.all_reduce(flat), 10))
    # one real epoch, every step timed: the sum is the epoch, the median is robust to the
    # bursts of other people's work on a shared machine
    sampler.set_epoch(1)
    dist.barrier()
    times = timed(lambda i: step(*batches[i]), len(batches))
    epoch_s, step_s = sum(times), statistics.median(times)
    # the slowest rank sets the pace of all
    m = torch.tensor([epoch_s, step_s, compute_s, allreduce_s], dtype=torch.float64, device=device)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    epoch_s, step_s, compute_s, allreduce_s = m.tolist()
    if rank == 0:
        metrics.log(0, world_size=world, epoch_s=epoch_s, steps=len(batches), step_s=step_s,
                    compute_s=compute_s, compute_max_s=compute_max_s, allreduce_s=allreduce_s, grad_bytes=nbytes,
                    samples_per_s=len(batches) * a.batch_size * world / epoch_s,
                    backend=dist.get_backend(), device=str(device))
    if a.extras:  # the all-reduce sweep and the DDP knobs in the same processes (saves launches)
        import allreduce_bandwidth
        import ddp_knobs
        sweep = allreduce_bandwidth.sweep(allreduce_bandwidth.QUICK_SIZES, iters=6, device=device)
        knobs = ddp_knobs.measure_configs(device, quick=True)
        if rank == 0:
            for i, (b, sec) in enumerate(sweep):
                metrics.log(i, kind="allreduce", bytes=b, seconds=sec, world_size=world,
                            backend=dist.get_backend())
            for i, r in enumerate(knobs):
                metrics.log(i, kind="knobs", world_size=world, backend=dist.get_backend(), **r)
    dist.destroy_process_group()


# -- driver side -----------------------------------------------------------------------
def default_nprocs(cpu=False):
    sys.path.insert(0, str(HERE.parent))
    from ddp_lesson import devices
    n = 0 if cpu else len(devices.list_gpus())
    if n == 0:
        return [1, 2, 4]
    return [k for k in (1, 2, 4, 8) if k <= n]


def run_one(nproc, quick=True, cpu=False, samples=None, batch_size=64, run_dir=None, timeout=300,
            extras=False):
    """One launch with `nproc` ranks; returns rank 0's row (with `extras`, also the rows of
    the all-reduce sweep and of the DDP knobs, under "allreduce" and "knobs")."""
    sys.path.insert(0, str(HERE.parent))
    from ddp_lesson import launch, runs
    samples = samples or (8192 if quick else 32768)  # quick: ~1 s of steps per launch, enough for a stable median
    run = launch.start(Path(__file__), nproc=nproc, cpu=cpu, run_dir=run_dir, timeout=timeout,
                       label=f"scaling-{nproc}", env={"OMP_NUM_THREADS": 1},
                       args=["--worker", "--samples", samples, "--batch-size", batch_size,
                             "--compute-steps", 16 if quick else 30] + (["--extras"] if extras else []))
    res = run.wait()
    if res["status"] != "ok":
        raise RuntimeError(f"scaling run with {nproc} rank(s) {res['status']}: {res.get('message')}")
    all_rows = runs.load(run.run_dir).rows
    row = [r for r in all_rows if "epoch_s" in r][0]
    row["nproc"], row["run_dir"] = nproc, str(run.run_dir)
    if extras:
        row["allreduce"] = [r for r in all_rows if r.get("kind") == "allreduce"]
        row["knobs"] = [r for r in all_rows if r.get("kind") == "knobs"]
    return row


def analyse(rows):
    """Add speedup, efficiency, predicted step/speed-up, compute share (utilisation)."""
    base = next(r for r in rows if r["nproc"] == 1)
    for r in rows:
        n = r["nproc"]
        # epoch time from the median step (robust to other people's bursts on the machine);
        # each rank does 1/n of the steps, so speed-up = n * step(1) / step(n)
        r["epoch_est_s"] = r["steps"] * r["step_s"]
        r["speedup"] = base["epoch_est_s"] / r["epoch_est_s"]
        r["efficiency"] = r["speedup"] / n
        comm = r["allreduce_s"] if n > 1 else 0.0
        r["pred_step_s"] = r["compute_max_s"] + comm  # the slowest rank's compute, then the all-reduce
    for r in rows:  # the model's speed-up: n * step(1) / step(n), with step = compute + all-reduce
        r["pred_speedup"] = r["nproc"] * base["pred_step_s"] / r["pred_step_s"]
        r["naive_speedup"] = float(n)
        r["utilisation"] = min(1.0, r["compute_s"] / r["step_s"])  # busy fraction of a step
    return rows


def measure(nprocs=None, quick=True, cpu=False, samples=None, batch_size=64, extras_at=None):
    """Launch once per rank count (1 always included); `extras_at`: the rank count whose
    launch also runs the all-reduce sweep and the DDP knobs."""
    nprocs = list(nprocs or default_nprocs(cpu))
    if 1 not in nprocs:
        nprocs = [1] + nprocs
    return analyse([run_one(n, quick=quick, cpu=cpu, samples=samples, batch_size=batch_size,
                            extras=(n == extras_at)) for n in nprocs])


def report(rows, out=sys.stdout):
    seeds = seed_speedups()
    dev = rows[0]["device"]
    print(f"SmallCNN on shapes, {rows[0]['backend']} ({dev}), per-rank batch fixed:", file=out)
    print(f"{'ranks':>5} {'s/epoch':>8} {'speed-up':>8} {'effic.':>7} {'compute':>9} {'allreduce':>9} "
          f"{'step':>8} {'model':>7} {'WZ V100':>8} {'2x3090':>7}", file=out)
    for r in rows:
        n = r["nproc"]
        wz = seeds["wz_v100"].get(n)
        g = seeds["3090"].get(n)
        print(f"{n:>5} {r['epoch_est_s']:8.2f} {r['speedup']:7.2f}x {r['efficiency']:6.0%} "
              f"{r['compute_s'] * 1e3:7.1f}ms {r['allreduce_s'] * 1e3 if n > 1 else 0:7.1f}ms "
              f"{r['step_s'] * 1e3:6.1f}ms {r['pred_speedup']:6.2f}x "
              f"{(f'{wz:.2f}x' if wz else '-'):>8} {(f'{g:.3f}x' if g else '-'):>7}", file=out)
    for r in rows[1:]:
        err = abs(r["pred_speedup"] - r["speedup"]) / r["speedup"]
        print(f"ratio: {r['nproc']} ranks: measured/predicted speed-up = {r['speedup'] / r['pred_speedup']:.2f} "
              f"(model error {err:.0%}); compute with {r['nproc']} ranks / with 1 = "
              f"{r['compute_s'] / rows[0]['compute_s']:.2f}x", file=out)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nprocs", help="comma-separated rank counts (default 1,2,4 on CPU, powers of 2 up to the GPUs)")
    p.add_argument("--quick", action="store_true", help="small epoch (CI)")
    p.add_argument("--cpu", action="store_true", help="CPU ranks on gloo even where GPUs exist")
    a = p.parse_args(argv)
    t = time.perf_counter()
    nprocs = [int(x) for x in a.nprocs.split(",")] if a.nprocs else None
    if a.quick and not nprocs:
        nprocs = [1, 2]
    rows = measure(nprocs, quick=a.quick, cpu=a.cpu)
    report(rows)
    print(f"{time.perf_counter() - t:.1f} s in all (timings on a shared machine are noisy)")


if __name__ == "__main__":
    main()
