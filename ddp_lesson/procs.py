"""Finding and ending the processes of a run: by PID (the tree under torchrun) and by the
DDP_LESSON_RUN_DIR every rank carries in its environment; never by name."""
import os
import signal
import time

import psutil

ENV_KEY = "DDP_LESSON_RUN_DIR"


def tree(pid):
    """The process and all its descendants that are alive now."""
    try:
        root = psutil.Process(pid)
        return [root] + root.children(recursive=True)
    except psutil.Error:
        return []


def create_time(pid):
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def is_alive(pid, started):
    """Is the process `pid` that started at `started` (not a reused PID) still running?"""
    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - started) < 0.01 and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, TypeError):
        return False


def run_processes(run_dir=None):
    """This user's processes carrying DDP_LESSON_RUN_DIR (equal to run_dir if given),
    except this one and its ancestors."""
    mine = {os.getpid()}
    try:
        mine.update(p.pid for p in psutil.Process().parents())
    except psutil.Error:
        pass
    want = os.path.abspath(run_dir) if run_dir else None
    uid = os.getuid() if hasattr(os, "getuid") else None
    found = []
    for p in psutil.process_iter():
        if p.pid in mine:
            continue
        try:
            if uid is not None and p.uids().real != uid:
                continue  # another user's runs are theirs
        except psutil.Error:
            continue
        try:
            value = p.environ().get(ENV_KEY)
        except psutil.Error:
            continue
        if value and (want is None or os.path.abspath(value) == want):
            found.append(p)
    return found


def alive(p):
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def by_run():
    """{run_dir: [processes]} of this user's ddp_lesson runs alive now."""
    groups = {}
    for p in run_processes():
        try:
            groups.setdefault(p.environ().get(ENV_KEY), []).append(p)
        except psutil.Error:
            pass
    return groups


def kill_all(procs, sig=signal.SIGKILL):
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


def wait_gone(procs, timeout):
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return alive


def end_tree(pid, grace=5.0, run_dir=None):
    """SIGTERM the root (torchrun tears its workers down), wait `grace` seconds, then
    SIGKILL whatever is left of the tree as it was and of the run's processes."""
    procs = tree(pid)
    known = {p.pid: p for p in procs}
    if procs:
        kill_all(procs[:1], signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and alive(procs[0]):
            time.sleep(0.05)
            for p in tree(pid):  # workers may start while we wait
                known.setdefault(p.pid, p)
    leftovers = list(known.values()) + (run_processes(run_dir) if run_dir else [])
    kill_all(leftovers)
    return wait_gone(leftovers, timeout=5)
