"""DDP speed-up on CPU: 2 ranks vs 1 rank on the lesson CNN, same global batch, one thread
per rank, measured side by side in one run.

    python bench/ddp_speedup.py [--quick] [--global-batch 512] [--rounds 10]

One torchrun launch with 2 CPU ranks (gloo). Rounds alternate two phases, so load from
anything else on the machine hits both alike:
  A. one process: rank 0 trains a plain SmallCNN on the whole global batch; rank 1 waits;
  B. DDP: both ranks train on half the global batch each.
The median samples/s of each phase and their ratio are printed (ideal: 2.0 on 2 free cores).
What makes it fast: pre-built tensors (no DataLoader, no worker processes competing for the
2 cores), OMP_NUM_THREADS=1 and torch.set_num_threads(1) per rank, gradient_as_bucket_view
(no copy between .grad and the all-reduce bucket), one bucket for the whole model
(bucket_cap_mb) and a global batch large enough that compute dwarfs the all-reduce.
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and rounds (a smoke test)")
    p.add_argument("--global-batch", type=int, default=512)
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per phase")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--no-bucket-view", action="store_true", help="gradient_as_bucket_view=False")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.rounds = 5, 3
    return args


def worker(args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_lesson.rank import data, models

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = data.shapes(args.global_batch, seed=0).tensors  # pre-built: no DataLoader
    half = args.global_batch // world
    mine = slice(rank * half, (rank + 1) * half)
    torch.manual_seed(0)
    single = models.SmallCNN()
    ddp = DDP(models.SmallCNN(), bucket_cap_mb=args.bucket_cap_mb,
              gradient_as_bucket_view=not args.no_bucket_view)
    opts = {"single": torch.optim.SGD(single.parameters(), lr=0.01, momentum=0.9),
            "ddp": torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)}

    def steps(model, opt, xb, yb, n):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
        return time.perf_counter() - t0, time.process_time() - c0

    steps(ddp, opts["ddp"], x[mine], y[mine], 2)  # warm up both
    if rank == 0:
        steps(single, opts["single"], x, y, 2)
    dist.barrier()
    n = args.global_batch * args.steps
    rates = {"1 rank": [], f"{world} ranks": []}
    cpu_rates = {"1 rank": [], f"{world} ranks": []}  # samples per CPU-second of the slowest rank
    for _ in range(args.rounds):
        if rank == 0:
            wall, cpu = steps(single, opts["single"], x, y, args.steps)
            rates["1 rank"].append(n / wall)
            cpu_rates["1 rank"].append(n / cpu)
        dist.barrier()
        t = torch.tensor(steps(ddp, opts["ddp"], x[mine], y[mine], args.steps), dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slower rank sets the pace
        rates[f"{world} ranks"].append(n / t[0].item())
        cpu_rates[f"{world} ranks"].append(n / t[1].item())
        dist.barrier()
    if rank == 0:
        # best-of: on a shared machine the fastest round is the one least disturbed
        out = {name: max(v) for name, v in rates.items()}
        out["ratio"] = out[f"{world} ranks"] / out["1 rank"]
        out["median"] = {name: statistics.median(v) for name, v in rates.items()}
        out["median_ratio"] = out["median"][f"{world} ranks"] / out["median"]["1 rank"]
        out["cpu_ratio"] = max(cpu_rates[f"{world} ranks"]) / max(cpu_rates["1 rank"])
        out["all"] = rates
        out["settings"] = vars(args)
        Path(os.environ.get("DDP_LESSON_RUN_DIR", "."), "speedup.json").write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)
    if "RANK" in os.environ:  # inside torchrun
        return worker(args)
    sys.path.insert(0, str(ROOT))
    from ddp_lesson.launcher import launch

    run = launch.start(__file__, nproc=2, cpu=True, args=sys.argv[1:] if argv is None else argv,
                       env={"OMP_NUM_THREADS": "1"}, timeout=900,
                       run_dir=None if os.environ.get("DDP_LESSON_RUNS") else
                       Path(os.environ.get("TMPDIR", "/tmp")) / f"ddp-speedup-{os.getpid()}-{time.time_ns()}")
    result = run.wait()
    if result["status"] != "ok":
        print(result.get("message"), file=sys.stderr)
        return 1
    out = json.loads((run.run_dir / "speedup.json").read_text())
    s = out["settings"]
    print(f"global batch {s['global_batch']}, {s['steps']} steps x {s['rounds']} rounds per phase, "
          f"1 thread per rank, gloo, bucket_cap_mb={s['bucket_cap_mb']}, "
          f"gradient_as_bucket_view={not s['no_bucket_view']}")
    print(f"1 rank : {out['1 rank']:8.0f} samples/s (best round; median {out['median']['1 rank']:.0f})")
    print(f"2 ranks: {out['2 ranks']:8.0f} samples/s (best round; median {out['median']['2 ranks']:.0f})")
    print(f"speed-up 2 vs 1: {out['ratio']:.2f}x best rounds, {out['median_ratio']:.2f}x medians "
          f"(ideal 2.0 on 2 free cores; seeds: 1.455x and 1.64x on 2 GPUs)")
    print(f"from CPU time (what free cores would give, waiting excluded): {out['cpu_ratio']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
