"""What watching a run costs: the same small training run (train_ddp.py, 2 CPU ranks) with
and without a RunPanel polling and redrawing, side by side in one process, in the order
A B B A (twice) so that a drift in machine load hits both alike. Prints the throughput ratio
(goal: within 5%) and the time to redraw a live plot of 10,000 points (goal: < 100 ms).

    python bench/panel_overhead.py            # 2 epochs, A B B A A B B A
    python bench/panel_overhead.py --quick    # 1 epoch, A B (for CI)
    python bench/panel_overhead.py --timing   # instead: the step-time fields off (A) / on (B)

--timing compares train_ddp.py with metrics.StepTimer off (DDP_LESSON_STEP_TIMES=0: no comm
hook, no data/compute/wait/memory fields) and on, same order, no panel (goal: within 2%).

Throughput is the samples/s the script logs per epoch (summed over ranks), which leaves
out process start-up; the wall time of each run is printed too. On a shared machine both
swing with other people's load, so the CPU time this process spent watching is printed as
well: it does not depend on the load, and its share of the machine's cores bounds what
the panel can take away from the ranks.
"""
import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ddp_lesson import devices, launch, plots  # noqa: E402
from ddp_lesson.widgets import DevicePicker, RunPanel  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "ddp_lesson" / "scripts" / "train_ddp.py"


def throughput(rows):
    vals = [r["samples_per_s"] for r in rows if "samples_per_s" in r and r.get("rank") == 0]
    return statistics.mean(vals) if vals else float("nan")


def plain_run(args, base, env=None):
    run = launch.start(SCRIPT, nproc=2, args=args, run_dir=Path(base) / f"plain-{time.time_ns()}", env=env)
    result = run.wait()
    run.metrics()
    return result, run.rows, None


def panel_run(args, base):
    panel = RunPanel(SCRIPT, options={}, picker=DevicePicker(gpus=[]), extra_args=args,
                     runs_base=base, label="panel")
    panel.run()
    result = panel.wait()
    return result, panel.last_run.rows, panel


def redraw_ms(points=10_000, repeats=5):
    rows = [{"rank": r, "step": s, "time": 1000.0 + s, "loss": 1.0 / s, "data_s": 0.001,
             "compute_s": 0.05 + 0.04 * r, "wait_s": 0.04 * (1 - r), "mem_mb": 700.0}
            for s in range(1, points // 2 + 1) for r in (0, 1)]
    live = plots.LivePlot(("loss", "test_accuracy"))   # + the step-time bars
    live.add(rows)
    live.render("warm-up")  # the first frame builds the figure
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        live.render("run: running")
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times), min(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 epoch, one pair of runs")
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--timing", action="store_true", help="step-time fields off (A) vs on (B), no panel")
    opts = ap.parse_args()
    epochs = opts.epochs or (1 if opts.quick else 2)
    order = "AB" if opts.quick else "ABBAABBA"
    args = ["--epochs", str(epochs)]
    base = tempfile.mkdtemp(prefix="panel-bench-")
    what = "A step times off, B on" if opts.timing else "A without panel, B with"
    print(f"{'step-time' if opts.timing else 'panel'} overhead: train_ddp.py --epochs {epochs} on 2 CPU"
          f" ranks, order {' '.join(order)} ({what})", flush=True)
    runners = {"A": lambda: plain_run(args, base, env={"DDP_LESSON_STEP_TIMES": "0"}),
               "B": lambda: plain_run(args, base)} if opts.timing else \
        {"A": lambda: plain_run(args, base), "B": lambda: panel_run(args, base)}
    got = {"A": [], "B": []}
    try:
        for which in order:
            cpu0, t0 = time.process_time(), time.monotonic()
            result, rows, panel = runners[which]()
            cpu = (time.process_time() - cpu0) / (time.monotonic() - t0)
            if result["status"] != "ok":
                print(f"  run {which} ended {result['status']}: {result.get('message', '')}")
                return 1
            tp = throughput(rows)
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
    if opts.timing:
        print(f"throughput ratio with/without step times: {ratio:.3f} "
              f"({'within' if ratio >= 0.98 else 'OUTSIDE'} the 2% goal); wall time ratio {wall_b / wall_a:.3f}")
        return 0
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
