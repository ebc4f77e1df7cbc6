"""What watching a run costs: the same small training run (ddp_basic.py, 2 ranks) with
and without a RunPanel polling and redrawing, side by side in one process, in the order
A B B A (twice) so that a drift in machine load hits both alike. Prints the throughput ratio
(goal: within 5%) and the time to redraw a live plot of 10,000 points (goal: < 100 ms).

    python bench/panel_overhead.py [--nproc 2]   # 2 epochs, A B B A A B B A
    python bench/panel_overhead.py --quick       # 1 epoch, A B (for CI)
    python bench/panel_overhead.py --timing [--steps 1500] [--warmup 10] [--nproc 2] [--quick]

Throughput is the samples/s the script logs per epoch (summed over ranks), which leaves
out process start-up; the wall time of each run is printed too. On a shared machine both
swing with other people's load, so the CPU time this process spent watching is printed as
well: it does not depend on the load, and its share of the machine's cores bounds what
the panel can take away from the ranks.

--timing: what the step-time fields cost (metrics.StepTimer: its gradient and optimizer hooks, the timed
loader, lap() and the four extra fields in each row; goal: within 2% of throughput). Whole
runs cannot show 2% on a shared machine: single runs of ddp_basic.py with one setting spread
7,800-10,000 samples/s here. So one launch builds ddp_basic.py's step three times (same
SmallCNN, shapes data, batch 64, SGD, metrics.log each step): A and A2 without the timer, B
with it, and takes them step by step in rotating order, so that a change in the machine's
load hits all three alike. The copies are built afresh in each of 6 rounds, in a rotated
order, so that where one copy's tensors landed in memory favours none. The throughput ratio
is the mean step time of A and A2 over that of B; A2 vs A compares two identical copies and
shows how far to trust this run (each ratio's range over the rounds is printed too). --nproc 1
has no other rank to wait for and resolves the cost best; the goal is about 2 ranks.
"""
import argparse
import itertools
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ddp_lesson.launcher import devices, launch, monitor, runs  # noqa: E402
from ddp_lesson.rank import metrics
from ddp_lesson.notebook import plots
from ddp_lesson.rank.bundled import script  # noqa: E402
from ddp_lesson.notebook.widgets import DevicePicker, RunPanel  # noqa: E402

SCRIPT = script("ddp_basic.py")
BATCH = 64  # per rank, as in the figures measured before (the reference script's default is 32)


def throughput(rows, nproc):
    """Samples/s over all ranks in each epoch (rank 0's steps x BATCH x ranks / epoch_s), averaged."""
    vals = [sum(1 for s in rows if s.get("rank") == 0 and "loss" in s and s.get("epoch") == r["epoch"])
            * BATCH * nproc / r["epoch_s"] for r in rows if "epoch_s" in r and r.get("rank") == 0]
    return statistics.mean(vals) if vals else float("nan")


def plain_run(args, base, nproc):
    run = launch.start(SCRIPT, nproc=nproc, args=args, run_dir=Path(base) / f"plain-{time.time_ns()}")
    result = run.wait()
    return result, runs.load(run.run_dir).rows, None


def panel_run(args, base, nproc):
    panel = RunPanel(SCRIPT, options={}, picker=DevicePicker(gpus=[], nproc=nproc), extra_args=args,
                     runs_base=base, label="panel")
    panel.run()
    result = panel.wait()
    return result, panel.rows, panel


ROUNDS = 6  # --timing: the steps are split over this many rounds, each with fresh copies


def timing_worker(steps, warmup=10):
    """One rank of --timing: ddp_basic.py's step, three copies, taken in turn."""
    import os

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from ddp_lesson.rank import data, metrics, models

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    train_set = data.get("shapes", train=True)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=64, sampler=sampler, drop_last=True)

    class Copy:
        def __init__(self, timed):
            torch.manual_seed(0)
            self.model = DDP(models.SmallCNN().to(device), device_ids=[local] if use_cuda else None)
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
            self.timer = metrics.StepTimer(self.model, self.opt) if timed else None
            self.batches, self.times, self.step, self.fields = None, [], 0, {}

        def next_batch(self):  # epoch after epoch, through the timer where there is one
            while True:
                if self.batches is None:
                    self.batches = self.timer.timed(loader) if self.timer else iter(loader)
                try:
                    return next(self.batches)
                except StopIteration:
                    self.batches = None

        def train_step(self):  # as in ddp_basic.py
            t = time.perf_counter()
            x, y = self.next_batch()
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(self.model(x), y)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.step += 1
            self.fields = self.timer.lap() if self.timer else {}
            metrics.log(self.step, loss=loss.item(), epoch=0, **self.fields)
            self.times.append(time.perf_counter() - t)

    names = ("A", "A2", "B")
    times = {name: [] for name in names}
    for r in range(ROUNDS):  # fresh copies each round, built in a rotated order: where a copy's
        order = names[r % 3:] + names[:r % 3]  # tensors land in memory must not favour one
        copies = {name: Copy(name == "B") for name in order}
        turns = list(itertools.permutations(copies.values()))
        for n in range(warmup + steps // ROUNDS):  # the first `warmup` turns are not counted
            if n == warmup:
                for c in copies.values():
                    c.times.clear()
            for c in turns[n % len(turns)]:
                c.train_step()
        for name, c in copies.items():
            times[name] += c.times
    metrics.log(0, kind="step_times", backend=dist.get_backend(), fields=sorted(copies["B"].fields), **times)
    dist.destroy_process_group()


def ratio_line(base, other, blocks=ROUNDS):
    """'r (per round lo-hi)': throughput of `other` over `base`, from mean step times."""
    whole = statistics.mean(base) / statistics.mean(other)
    size = len(base) // blocks
    parts = [statistics.mean(base[i:i + size]) / statistics.mean(other[i:i + size])
             for i in range(0, size * blocks, size)]
    return whole, f"{whole:.3f} ({blocks} rounds of {size} steps: {min(parts):.3f}-{max(parts):.3f})"


def timing(steps, nproc=2, warmup=10):
    print(f"step-time overhead: ddp_basic.py's step on {nproc} rank(s), {steps} steps each of A and A2 "
          f"(no timer) and B (StepTimer), taken in turn in one launch", flush=True)
    base = tempfile.mkdtemp(prefix="timing-bench-")
    try:
        gpus = [g.index for g in devices.list_gpus()][:nproc] or None   # GPUs by id: one GPU is not a default
        run = launch.start(Path(__file__), nproc=nproc, gpus=gpus, args=["--timing-worker", str(steps), str(warmup)],
                           run_dir=Path(base) / "run", env={"OMP_NUM_THREADS": 1}, timeout=900)
        result = run.wait()
        if result["status"] != "ok":
            print(f"  run ended {result['status']}: {result.get('message', '')}")
            return 1
        row = next(r for r in runs.load(run.run_dir).rows if r.get("kind") == "step_times" and r["rank"] == 0)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    a, a2, b = row["A"], row["A2"], row["B"]
    if sorted(metrics.TIME_KEYS + ("mem_mb",)) != row["fields"]:
        print(f"  B's rows carry {row['fields']}, not the step-time fields: is DDP_LESSON_STEP_TIMES=0 set?")
        return 1
    for name, t in (("A ", a), ("A2", a2), ("B ", b)):
        print(f"  {name}: {statistics.mean(t) * 1000:6.2f} ms per step mean, {statistics.median(t) * 1000:6.2f} median")
    r_b, text_b = ratio_line([(x + y) / 2 for x, y in zip(a, a2)], b)
    _, text_null = ratio_line(a, a2)
    print(f"same step twice, no timer (A2 vs A): {text_null}: the bench's resolution in this run")
    print(f"throughput ratio with/without step times (B vs A and A2): {text_b} "
          f"({'within' if r_b >= 0.98 else 'OUTSIDE'} the 2% goal) on {row['backend']}")
    return 0


def redraw_ms(points=10_000, repeats=5):
    rows = [{"rank": r, "step": s, "time": 1000.0 + s, "loss": 1.0 / s, "data_s": 0.001,
             "compute_s": 0.05 + 0.04 * r, "wait_s": 0.04 * (1 - r), "mem_mb": 700.0}
            for s in range(1, points // 2 + 1) for r in (0, 1)]
    live = plots.LivePlot(("loss", "test_accuracy"))   # + the step-time bars
    live.add(rows)
    steps = runs.StepTimes(window=monitor.TIME_WINDOW).add(rows)
    slow = steps.stragglers()           # the monitor's verdict, judged once per poll, not per frame
    live.render("warm-up", times=steps, stragglers=slow)  # the first frame builds the figure
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        live.render("run: running", times=steps, stragglers=slow)
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times), min(times)


def main():
    if sys.argv[1:2] == ["--timing-worker"]:
        return timing_worker(int(sys.argv[2]), int(sys.argv[3]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 epoch, one pair of runs (--timing: 150 steps)")
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--timing", action="store_true", help="instead: what the step-time fields cost")
    ap.add_argument("--steps", type=int, default=None, help="--timing: steps of each copy (1500)")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (--timing: one per GPU where there are GPUs)")
    ap.add_argument("--warmup", type=int, default=10, help="--timing: turns per round not counted (10)")
    opts = ap.parse_args()
    if opts.timing:
        return timing(opts.steps or (150 if opts.quick else 1500), opts.nproc, opts.warmup)
    epochs = opts.epochs or (1 if opts.quick else 2)
    order = "AB" if opts.quick else "ABBAABBA"
    args = ["--epochs", str(epochs), "--batch-size", str(BATCH)]
    base = tempfile.mkdtemp(prefix="panel-bench-")
    print(f"panel overhead: ddp_basic.py --epochs {epochs} on {opts.nproc} CPU rank(s), order {' '.join(order)}"
          f" (A without panel, B with)", flush=True)
    runners = {"A": lambda: plain_run(args, base, opts.nproc), "B": lambda: panel_run(args, base, opts.nproc)}
    got = {"A": [], "B": []}
    try:
        for which in order:
            cpu0, t0 = time.process_time(), time.monotonic()
            result, rows, panel = runners[which]()
            cpu = (time.process_time() - cpu0) / (time.monotonic() - t0)
            if result["status"] != "ok":
                print(f"  run {which} ended {result['status']}: {result.get('message', '')}")
                return 1
            tp = throughput(rows, opts.nproc)
            extra = f", {panel.frames} frames, last {panel.frame_s * 1000:.0f} ms" if panel else ""
            print(f"  {which}: {tp:7.0f} samples/s, {result['duration_s']:5.1f} s wall, "
                  f"watcher CPU {cpu:.1%} of one core{extra}", flush=True)
            got[which].append((tp, result["duration_s"], cpu))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    # medians: one run disturbed by something else on the machine must not decide it
    a, wall_a, cpu_a = (statistics.median(v) for v in zip(*got["A"]))
    b, wall_b, cpu_b = (statistics.median(v) for v in zip(*got["B"]))
    ratio = b / a
    print(f"throughput ratio with/without panel: {ratio:.3f} "
          f"({'within' if ratio >= 0.95 else 'OUTSIDE'} the 5% goal); "
          f"wall time ratio {wall_b / wall_a:.3f}")
    cores = devices.cpu_count()
    print(f"panel's own CPU: {cpu_b - cpu_a:.1%} of one core = {(cpu_b - cpu_a) / cores:.1%} of "
          f"this machine's {cores} cores (the most it can take from the ranks)")
    median, best = redraw_ms()
    print(f"redraw of 10,000 points: {median:.0f} ms median, {best:.0f} ms best "
          f"({'under' if median < 100 else 'OVER'} the 100 ms goal)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
