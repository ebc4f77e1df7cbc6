"""A live world (ddp_lesson.launcher.world) against launching a script, side by side in one run:

1. launching a script: launch.start(bench/hello.py) until it has finished (torchrun,
   import torch, init_process_group, one all_reduce, exit) vs starting a world until every
   rank is ready; alternated, median of each; goal: world start <= 1.2x a script launch;
2. a cell round trip, world.run("dist.barrier()") on every rank, median of many;
   goal <= 0.3 s (vs the seconds of a launch).

    python bench/world_roundtrip.py [--nproc 4] [--repeat 3] [--cells 30] [--quick]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from ddp_lesson.launcher import launch, world  # noqa: E402


def launch_script(nproc):
    t = time.perf_counter()
    run = launch.start(HERE / "hello.py", nproc=nproc, cpu=True, label="hello")
    result = run.wait()
    if result["status"] != "ok":
        raise SystemExit(f"hello.py failed: {result.get('message')}")
    return time.perf_counter() - t


def world_session(nproc, cells):
    """(start s, [round trip s], stop s) of one world."""
    t = time.perf_counter()
    w = world.start(nproc=nproc, cpu=True)
    started = time.perf_counter() - t
    trips = []
    try:
        w.run("dist.barrier()")  # the first collective sets up gloo's pairs; not a round trip
        for _ in range(cells):
            t = time.perf_counter()
            res = w.run("dist.barrier()")
            trips.append(time.perf_counter() - t)
            assert all(r.error is None for r in res), res
    finally:
        t = time.perf_counter()
        w.stop()
        stopped = time.perf_counter() - t
    return started, trips, stopped


def fmt(xs):
    return ", ".join(f"{x:.2f}" for x in xs)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, help="CPU ranks (default 4, --quick 2)")
    p.add_argument("--repeat", type=int, default=3, help="launches and worlds, alternated (default 3)")
    p.add_argument("--cells", type=int, default=30, help="round trips per world (default 30)")
    p.add_argument("--quick", action="store_true", help="2 ranks, 1 launch and 1 world, 10 round trips (CI)")
    a = p.parse_args()
    if a.quick:
        a.repeat, a.cells = 1, 10
    a.nproc = a.nproc or (2 if a.quick else 4)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("DDP_LESSON_RUNS", tmp)  # run directories are throwaway here
        launches, starts, stops, trips = [], [], [], []
        for _ in range(a.repeat):
            launches.append(launch_script(a.nproc))
            started, cell_times, stopped = world_session(a.nproc, a.cells)
            starts.append(started)
            stops.append(stopped)
            trips += cell_times
    med_launch, med_start = statistics.median(launches), statistics.median(starts)
    med_trip = statistics.median(trips)
    print(f"{a.nproc} CPU ranks (gloo), {os.cpu_count()} CPU cores")
    print(f"script launch (hello.py, until done): median {med_launch:.2f} s  ({fmt(launches)})")
    print(f"world start (until every rank ready): median {med_start:.2f} s  ({fmt(starts)})")
    print(f"world stop:                           median {statistics.median(stops):.2f} s  ({fmt(stops)})")
    print(f"cell round trip dist.barrier():       median {med_trip * 1000:.1f} ms, "
          f"max {max(trips) * 1000:.1f} ms over {len(trips)} cells (goal <= 300 ms)")
    print(f"ratio: world start / script launch = {med_start / med_launch:.2f}x (goal <= 1.2x)")
    print(f"ratio: script launch / cell round trip = {med_launch / med_trip:.0f}x "
          f"(what a cell saves against launching a script)")


if __name__ == "__main__":
    main()
