"""A run's processes are found by identity, never by name, and without rewriting any
process's environment (procs.run_processes, by_run, Run.pids, the agent's sweep): a forked
warm rank shows its warm process's environment in /proc, so it is found by its pid file
(logs/rank<R>.pid) and its warm process's note; what a rank forks (a DataLoader worker below
it, a daemon that left its tree in a new session) by the tree below it and the pid file each
fork of a warm rank writes. Warm and cold, each is found and ended with the run. A stale pid
file whose PID now belongs to another process names nothing: that process is never signalled.
"""
import json
import os
import subprocess
import sys

import psutil
import pytest

from conftest import wait_until
from ddp_lesson.launcher import launch
from ddp_lesson.rank import procs, rundir

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and fork")

HOLD = """
import json, os, time
import torch
from torch.utils.data import DataLoader

run_dir, rank = os.environ["DDP_LESSON_RUN_DIR"], os.environ["RANK"]
here = os.path.join(run_dir, "held")
os.makedirs(here, exist_ok=True)

if os.fork() == 0:          # a daemon: a new session, then its parent leaves (reparented away)
    os.setsid()
    if os.fork() == 0:
        with open(os.path.join(here, "daemon%s" % rank), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(300)
    os._exit(0)


def note_worker(_):
    with open(os.path.join(here, "worker%s" % rank), "w") as f:
        f.write(str(os.getpid()))


loader = iter(DataLoader(list(range(100)), num_workers=1, multiprocessing_context="fork",
                         worker_init_fn=note_worker))
next(loader)
with open(os.path.join(here, "rank%s.json" % rank), "w") as f:
    json.dump({"pid": os.getpid()}, f)
time.sleep(300)
"""


def _held(run_dir, nproc):
    """{rank: (rank pid, worker pid, daemon pid)} once every rank has said them all, else None."""
    here = run_dir / "held"
    try:
        return {r: (json.loads((here / f"rank{r}.json").read_text())["pid"],
                    int((here / f"worker{r}").read_text()), int((here / f"daemon{r}").read_text()))
                for r in range(nproc)}
    except (OSError, ValueError):
        return None


def _gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


@pytest.mark.parametrize("cold", [False, True], ids=["warm", "cold"])
def test_ranks_their_dataloader_workers_and_daemons_are_found_and_ended(cold, write_script):
    if not cold:
        assert launch.warm_up().ready(120)
    run = launch.start(write_script("hold.py", HOLD), nproc=2, cpu=True, cold=cold, timeout=240)
    try:
        held = wait_until(lambda: _held(run.run_dir, 2), timeout=180, interval=0.2)
        assert held is not None, (run.poll(), run.result)
        assert run.config["launch"]["mode"] == ("cold" if cold else "warm")
        pids = {pid for trio in held.values() for pid in trio}
        rank_pids = {trio[0] for trio in held.values()}
        if not cold:   # a forked rank's /proc environ is its warm process's: not how it is found
            for pid in rank_pids:
                assert rundir.ENV not in psutil.Process(pid).environ()
        assert pids <= {p.pid for p in procs.run_processes(run.run_dir)}
        assert pids <= {p.pid for p in procs.by_run().get(os.path.abspath(run.run_dir), [])}   # cleanup's view
        assert rank_pids <= {p.pid for p in procs.ranks(run.run_dir)}
        assert rank_pids <= set(run.pids())
    finally:
        run.stop()
    assert run.result["status"] == "interrupted"
    assert wait_until(lambda: all(_gone(p) for p in pids), timeout=10) is not None, \
        [p for p in pids if not _gone(p)]
    assert not procs.run_processes(run.run_dir)


def test_a_stale_pid_file_whose_pid_was_reused_names_nothing(tmp_path):
    run_dir = tmp_path / "run"
    rundir.logs(run_dir).mkdir(parents=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ticks = rundir.start_ticks(other.pid)
        # the file says this PID started a tick earlier: a run's process that ended, whose PID was reused
        rundir.pid_file(run_dir, "rank0").write_text(f"{other.pid} {ticks - 1}\n")
        assert procs.recorded(run_dir) == [] and procs.ranks(run_dir) == []
        assert other.pid not in {p.pid for p in procs.run_processes(run_dir)}
        procs.end_tree(None, grace=0, run_dir=run_dir)
        assert other.poll() is None, "a process named by a stale pid file was killed"
        # the same file with its true start time names it (so the check above can fail)
        rundir.pid_file(run_dir, "rank0").write_text(f"{other.pid} {ticks}\n")
        assert [p.pid for p in procs.ranks(run_dir)] == [other.pid]
        assert other.pid in {p.pid for p in procs.run_processes(run_dir)}
    finally:
        other.kill()
        other.wait()
