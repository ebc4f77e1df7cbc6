"""What starting processes costs, in CPU seconds, measured side by side in one run:

1. a bare Python (`python -c pass`);
2. `python -c "import torch"`;
3. a torchrun launch whose ranks join a gloo group and all_reduce once;
4. the same with a DDP model, one step and an optimizer (`DDP(...)` and the optimizer's
   constructor import torch._dynamo as well);
5. the course's launcher, cold (what 4 does, under the guards) and warm (agent and ranks
   forked from warm processes, one per local rank, that have imported torch): the DDP step of 4, and the
   reference training script (ddp_basic.py), 1 epoch: CPU-s per launch, Run to the first metric row, the
   whole run. Cold and warm alternate, so a burst of other load hits both alike.

On a small CPU machine most of the test suite's time is this start-up, paid once per
launch and once per rank: multiply by the launches a run makes. The last line says how many
launches like (4) a time budget pays for on this machine's cores, with nothing else running.
Launches here are bare torchrun (the course's launcher adds its guards: see
launcher_overhead.py), with OMP_NUM_THREADS=1 per rank as the course sets on CPU.

    python bench/launch_cost.py [--quick] [--repeat N] [--nproc 2] [--budget-min 14] [--only-course]
"""
import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GLOO = """import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
"""
DDP = """import torch, torch.distributed as dist
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.ones(4, 8)).sum().backward()
opt.step()
dist.destroy_process_group()
"""


def children_cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def cost(cmd, cwd, env):
    """(CPU seconds, wall seconds) of running cmd to the end; the CPU of every process it
    waited for is counted (torchrun waits for its ranks)."""
    cpu, wall = children_cpu(), time.perf_counter()
    subprocess.run(cmd, cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return children_cpu() - cpu, time.perf_counter() - wall


def cpu_of(pid, children=False):
    """CPU seconds of process `pid` itself (proc(5) stat fields 14 and 15), or of the children
    it has reaped (fields 16 and 17)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()   # fields[0] is field 3
    first = 13 if children else 11
    return (int(fields[first]) + int(fields[first + 1])) / os.sysconf("SC_CLK_TCK")


def course_launch(script, nproc, args, cold, server):
    """(CPU-s, s to the first metric row or None, s in all) of one launch.start to its end."""
    from ddp_lesson.launcher import launch, runs
    before = children_cpu() if cold else cpu_of(server.pid, children=True)
    t0 = time.perf_counter()
    run = launch.start(script, nproc=nproc, cpu=True, args=args, cold=cold)
    tail, first = runs.MetricsTail(run.run_dir), None
    while not run.done():
        if first is None and tail.read():
            first = time.perf_counter() - t0
        time.sleep(0.01)
    whole = time.perf_counter() - t0
    result = run.wait()
    if result["status"] != "ok" or run.config["launch"]["mode"] != ("cold" if cold else "warm"):
        raise SystemExit(f"launch failed or went another way: {result} {run.config['launch']}")
    if first is None and tail.read():
        first = whole
    after = children_cpu() if cold else cpu_of(server.pid, children=True)
    return after - before, first, whole


def course(repeat, nproc, tmp):
    """Section 5: cold vs warm through the course's launcher."""
    from ddp_lesson.launcher import launch
    from ddp_lesson.rank.bundled import script
    os.chdir(tmp)
    server = launch.warm_up()
    t0 = time.perf_counter()
    if server is None or not server.ready(120):
        print("no warm process here (not Linux, or DDP_LESSON_COLD is set): section 5 skipped")
        return
    up = time.perf_counter() - t0
    print(f"the warm process: up {up:.1f} s after warm_up(), "
          f"{cpu_of(server.pid):.2f} CPU-s of its own (paid once per launcher)")
    cases = {"DDP step": (str(Path(tmp) / "ddp.py"), []),
             "reference script, 1 epoch": (str(script("ddp_basic.py")), ["--epochs", "1"])}
    seen = {(name, mode): [] for name in cases for mode in ("cold", "warm")}
    for _ in range(repeat):
        for name, (script, args) in cases.items():
            for mode in ("cold", "warm"):
                seen[name, mode].append(course_launch(script, nproc, args, mode == "cold", server))
    print(f"course launcher, {nproc} rank(s), median of {repeat}:")
    for name in cases:
        med = {}
        for mode in ("cold", "warm"):
            rows = seen[name, mode]
            firsts = [f for _, f, _ in rows if f is not None]
            med[mode] = (statistics.median(c for c, _, _ in rows),
                         statistics.median(firsts) if firsts else None,
                         statistics.median(w for _, _, w in rows))
            cpu, first, whole = med[mode]
            first_s = f"{first:6.2f} s to the first metric row" if first is not None else "no metric rows"
            print(f"  {name:<27} {mode}: {cpu:6.2f} CPU-s  {first_s}  {whole:6.2f} s in all")
        (c_cpu, c_first, c_whole), (w_cpu, w_first, w_whole) = med["cold"], med["warm"]
        line = f"  ratio warm / cold, {name}: CPU {w_cpu / c_cpu:.2f}, whole run {w_whole / c_whole:.2f}"
        if c_first and w_first:
            line += f", first metric row {w_first / c_first:.2f}"
        print(line)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one of each, at 1 rank, without (3)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--budget-min", type=float, default=14, help="a time budget, in minutes")
    ap.add_argument("--only-course", action="store_true", help="only section 5 (cold vs warm)")
    a = ap.parse_args()
    repeat, nproc = (1, 1) if a.quick else (a.repeat, a.nproc)
    cores = len(os.sched_getaffinity(0))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "gloo.py").write_text(GLOO)
        (Path(tmp) / "ddp.py").write_text(DDP)
        if a.only_course:
            course(repeat, nproc, tmp)
            return
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
        cases = {"python -c pass": [sys.executable, "-c", "pass"],
                 "python -c 'import torch'": [sys.executable, "-c", "import torch"],
                 f"torchrun, {nproc} rank(s): gloo all_reduce": torchrun + ["gloo.py"],
                 f"torchrun, {nproc} rank(s): DDP step": torchrun + ["ddp.py"]}
        if a.quick:
            del cases[f"torchrun, {nproc} rank(s): gloo all_reduce"]
        cost(cases["python -c 'import torch'"], tmp, env)   # warm the file cache
        seen = {name: [] for name in cases}
        for _ in range(repeat):   # alternated: a burst of other load hits every case alike
            for name, cmd in cases.items():
                seen[name].append(cost(cmd, tmp, env))
        if not a.quick:
            course(repeat, nproc, tmp)
    med = {name: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v))
           for name, v in seen.items()}
    print(f"start-up cost, median of {repeat}, {cores} cores, load {os.getloadavg()[0]:.1f}:")
    for name, (cpu, wall) in med.items():
        print(f"  {name:<40} {cpu:6.2f} CPU-s  {wall:6.2f} s")
    bare = med["python -c pass"][0]
    torch_cpu = med["python -c 'import torch'"][0]
    ddp = med[f"torchrun, {nproc} rank(s): DDP step"][0]
    print(f"ratio: import torch / bare python = {torch_cpu / bare:.0f}x")
    print(f"ratio: DDP launch at {nproc} rank(s) / import torch = {ddp / torch_cpu:.1f}x "
          f"(torchrun's agent and each rank import torch)")
    budget = a.budget_min * 60 * cores
    print(f"a budget of {a.budget_min:g} min on {cores} cores ({budget:.0f} CPU-s) pays for "
          f"{budget / ddp:.0f} such launches, with nothing else running")


if __name__ == "__main__":
    main()
