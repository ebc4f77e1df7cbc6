"""Launcher cost, measured side by side in one run:

1. wall time of `python -m ddp_lesson run hello.py --nproc 2` vs bare
   `python -m torch.distributed.run --standalone --nproc-per-node 2 hello.py`,
   alternated, median of N each; goal <= 1.15x (1.10x);
2. delay from a metric row being written to runs.MetricsTail.read() returning it, as a live
   view reads it (goal < 0.5 s).

    python bench/launcher_overhead.py [--quick] [--repeat N] [--nproc 2]
"""
import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def timed(cmd, cwd):
    t = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def overhead(repeat, warm=True, nproc=2):
    with tempfile.TemporaryDirectory() as tmp:
        bare = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                str(HERE / "hello.py")]
        ours = [sys.executable, "-m", "ddp_lesson", "run", str(HERE / "hello.py"), "--nproc", str(nproc), "--quiet",
                "--cpu"]
        times = {"torchrun": [], "ddp_lesson run": []}
        if warm:
            timed(bare, tmp)  # warm the file cache for both
        for i in range(repeat):
            times["torchrun"].append(timed(bare, tmp))
            times["ddp_lesson run"].append(timed(ours + ["--run-dir", f"{tmp}/r{i}"], tmp))
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["ddp_lesson run"] / med["torchrun"]
    for k, v in times.items():
        print(f"{k:>15}: median {med[k]:.2f} s  ({', '.join(f'{x:.2f}' for x in v)})")
    print(f"launcher overhead ratio ({nproc} rank(s)): {ratio:.3f}x (goal <= 1.10x, limit 1.15x)")
    return ratio


def metric_latency(rows):
    from ddp_lesson.launcher import launch, runs
    with tempfile.TemporaryDirectory() as tmp:
        run = launch.start(HERE / "metrics_writer.py", nproc=1, cpu=True, args=[str(rows)],
                           run_dir=Path(tmp) / "run")
        tail, delays = runs.MetricsTail(run.run_dir), []
        while not run.done() or delays == []:
            now = time.time()
            delays += [now - r["time"] for r in tail.read()]
            if run.done():
                break
            time.sleep(0.05)
        run.wait()
        delays += [time.time() - r["time"] for r in tail.read()]
    delays.sort()
    print(f"metric row -> MetricsTail.read(): {len(delays)} rows, median {statistics.median(delays) * 1000:.0f} ms, "
          f"max {delays[-1] * 1000:.0f} ms (goal < 500 ms; polling every 50 ms)")
    return delays[-1]


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one launch of each, no warm-up (a smoke test for CI)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2, help="ranks of both launches (default 2)")
    a = p.parse_args()
    overhead(1 if a.quick else a.repeat, warm=not a.quick, nproc=a.nproc)
    metric_latency(30 if a.quick else 150)
