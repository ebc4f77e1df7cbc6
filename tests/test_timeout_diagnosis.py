"""Where the ranks were when a run timed out (ddp_lesson/launcher/stacks.py), read from real
ranks, warm and cold: the same, right diagnosis in both modes. A forked (warm) rank's stack
holds torch's elastic agent and multiprocessing below the script, all in torch/distributed;
read as the script's frames, they named a rank that never called init_process_group "in the
collective <module>" and a busy loop a collective (shared/reviews/warm_adversary.md, 3).

Each case waits until every rank printed that it reached its place, then asks the ranks for
their stacks as the launcher does on a timeout (SIGUSR1 to the agent's children) and reads
them with stacks.where; one case goes through a real launch timeout. Plain torchrun has no
diagnosis: it hangs.
"""
import signal
import sys

import pytest

from conftest import wait_until
from ddp_lesson.launcher import launch, runs, stacks
from ddp_lesson.rank import procs
from ddp_lesson.rank.bundled import script as lesson_script

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGUSR1 stacks need Linux"),
              pytest.mark.timeout(240)]

MODES = [pytest.param(False, id="warm"), pytest.param(True, id="cold")]

# the last rank never calls init_process_group; the others wait there for it
NO_INIT = """
import os, time
import torch.distributed as dist
last = int(os.environ["WORLD_SIZE"]) - 1
if int(os.environ["RANK"]) == last:
    print("reached", flush=True)
    time.sleep(3600)
print("reached", flush=True)
dist.init_process_group("gloo")
"""

# the last rank spins in a Python loop; the others wait for it in a barrier
BUSY = """
import os
import torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == dist.get_world_size() - 1:
    print("reached", flush=True)
    n = 0
    while True:
        n += 1
print("reached", flush=True)
dist.barrier()
"""


def where_now(run, nproc, said):
    """Once every rank printed `said` (each rank's line), the stacks the launcher would read."""
    reached = wait_until(lambda: run.done() or all(said[r] in runs.log_tail(run.run_dir, rank=r)
                                                   for r in range(nproc)), 120)
    assert reached and not run.done(), (run.result, [runs.log_tail(run.run_dir, rank=r) for r in range(nproc)])
    ranks = procs.ranks(run.run_dir)   # from their pid files: a warm rank is not the agent's child
    assert len(ranks) == nproc, ranks
    for p in ranks:
        p.send_signal(signal.SIGUSR1)
    where = wait_until(lambda: (w := stacks.where(run.run_dir, nproc)) and len(w) == nproc
                       and all(x["complete"] for x in w.values()) and w, 20)
    assert where, stacks.where(run.run_dir, nproc)
    return where


def started(script, nproc, cold, run_dir, args=()):
    run = launch.start(script, nproc=nproc, cpu=True, cold=cold, args=list(args), timeout=300, run_dir=run_dir)
    assert run.config["launch"]["mode"] == ("cold" if cold else "warm"), run.config["launch"]
    return run


def lines_of(path, text):
    return [i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line]


@pytest.mark.parametrize("cold", MODES)
def test_a_rank_that_never_calls_init_is_the_one_named(cold, write_script, tmp_run_dir):
    script = write_script("no_init.py", NO_INIT)
    run = started(script, 2, cold, tmp_run_dir)
    try:
        where = where_now(run, 2, ["reached"] * 2)
    finally:
        run.stop()
    sleep_line, = lines_of(script, "time.sleep(3600)")
    init_line, = lines_of(script, 'init_process_group("gloo")')
    assert where[0]["state"] == "init" and where[0]["call"] == "init_process_group", where
    assert where[0]["at"] == f"script.py line {init_line}", where
    assert where[1] == {"state": "busy", "call": None, "at": f"script.py line {sleep_line}", "complete": True}
    message = stacks.timeout_message(9, where)
    assert (f"rank(s) 0 waited in init_process_group (rank 0 at script.py line {init_line}) for ranks "
            f"that never joined (rank 1 at script.py line {sleep_line})") in message, message
    assert "collective" not in message, message


@pytest.mark.parametrize("cold", MODES)
def test_a_rank_that_skips_an_all_reduce_waits_in_the_next_collective(cold, tmp_run_dir):
    """Notebook 07's hang: hang.py's last rank skips the second all_reduce and waits in the
    barrier after it; the others wait in that all_reduce."""
    hang = lesson_script("hang.py")
    run = started(hang, 2, cold, tmp_run_dir, ["--mode", "skip"])
    try:
        where = where_now(run, 2, ["waiting in the second all_reduce", "first all_reduce done"])
    finally:
        run.stop()
    source = hang.read_text().splitlines()
    at = {r: int(where[r]["at"].rsplit(" ", 1)[1]) for r in where}
    assert where[0]["state"] == "collective" and where[0]["call"] == "all_reduce", where
    assert where[1]["state"] == "collective" and where[1]["call"] == "barrier", where
    assert "dist.all_reduce(grad)" in source[at[0] - 1] and "dist.barrier()" in source[at[1] - 1], where
    message = stacks.timeout_message(9, where)
    assert "rank(s) 0, 1 waited in the collective all_reduce, barrier" in message, message
    assert "different collectives" in message, message


@pytest.mark.parametrize("cold, nproc", [pytest.param(False, 2, id="warm"), pytest.param(True, 2, id="cold"),
                                         pytest.param(False, 3, id="warm-3")])
def test_a_rank_busy_in_a_python_loop_is_busy_not_in_a_collective(cold, nproc, write_script, tmp_run_dir):
    script = write_script("busy.py", BUSY)
    run = started(script, nproc, cold, tmp_run_dir)
    try:
        where = where_now(run, nproc, ["reached"] * nproc)
    finally:
        run.stop()
    # the signal is handled where the loop checks for it: on its `while` line or its body's
    loop_lines = {*lines_of(script, "while True:"), *lines_of(script, "n += 1")}
    barrier, = lines_of(script, "dist.barrier()")
    last = nproc - 1
    loop = int(where[last]["at"].rsplit(" ", 1)[1])
    assert loop in loop_lines, where
    assert where[last] == {"state": "busy", "call": None, "at": f"script.py line {loop}", "complete": True}
    waiting = list(range(last))
    for r in waiting:
        assert where[r] == {"state": "collective", "call": "barrier", "at": f"script.py line {barrier}",
                            "complete": True}, where
    message = stacks.timeout_message(9, where)
    assert f"rank(s) {', '.join(map(str, waiting))} waited in the collective barrier" in message, message
    assert f"which rank {last} at script.py line {loop} never reached" in message, message


@pytest.mark.parametrize("cold", MODES)
def test_a_launch_timeout_names_the_rank_that_never_joined(cold, write_script, tmp_path):
    """The same through the launcher's own timeout: its result's message. The timeout doubles
    if the ranks had not reached their places by then (a busy machine)."""
    script = write_script("no_init.py", NO_INIT)
    timeout = 10 if not cold else 20
    for attempt in range(3):
        run = launch.start(script, nproc=2, cpu=True, cold=cold, timeout=timeout, run_dir=tmp_path / f"run{attempt}")
        result = run.wait()
        if all("reached" in runs.log_tail(run.run_dir, rank=r) for r in range(2)):
            break
        timeout *= 2
    assert result["status"] == "timeout", result
    assert run.config["launch"]["mode"] == ("cold" if cold else "warm"), run.config["launch"]
    message = result["message"]
    assert "rank(s) 0 waited in init_process_group" in message, message
    assert "for ranks that never joined (rank 1 at script.py line" in message, message
    assert "collective" not in message, message
