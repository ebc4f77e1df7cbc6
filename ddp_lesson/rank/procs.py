"""Finding and ending the processes of a run: by PID (the tree under torchrun) and by the
run's identity every process of it carries in its environment (DDP_LESSON_RUN_DIR and the
per-run DDP_LESSON_RUN_TOKEN, also kept in config.json); never by name."""
import os
import signal
import time

import psutil

from . import rundir

FOR_ENV = "DDP_LESSON_WARM_FOR"   # a warm process's own variable: "PID CREATE_TIME" of its launcher


def tree(pid):
    """The process and all its descendants that are alive now. `pid` may be a
    psutil.Process, which cannot be confused with a later process reusing its PID."""
    if pid is None:
        return []
    try:
        root = pid if isinstance(pid, psutil.Process) else psutil.Process(pid)
        if not root.is_running():
            return []
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


def run_processes(run_dir=None, token=None):
    """This user's processes carrying DDP_LESSON_RUN_DIR (equal to run_dir if given, and
    DDP_LESSON_RUN_TOKEN equal to token if given), except this one and its ancestors."""
    try:
        ancestors = {p.pid for p in psutil.Process().parents()}
    except psutil.Error:
        ancestors = set()
    want = os.path.abspath(run_dir) if run_dir else None
    found = []
    for p in _mine():
        if p.pid in ancestors:
            continue
        try:
            env = p.environ()
        except psutil.Error:
            continue
        value = env.get(rundir.ENV)
        if value and (want is None or os.path.abspath(value) == want) \
                and (token is None or env.get(rundir.TOKEN_ENV) == token):
            found.append(p)
    return found


def warm_processes():
    """{process: (launcher pid, launcher start time)} of this user's warm processes (the
    ones warm launches fork from), found by the variable each carries in its environment."""
    found = {}
    for p in _mine():
        try:
            value = p.environ().get(FOR_ENV)
        except psutil.Error:
            continue
        if value:
            pid, _, started = value.partition(" ")
            try:
                found[p] = (int(pid), float(started))
            except ValueError:
                found[p] = (None, None)
    return found


def _mine():
    """This user's processes but this one: another user's runs are theirs."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and (uid is None or p.uids().real == uid):
                yield p
        except psutil.Error:
            continue


def alive(p):
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def by_run():
    """{run_dir: [processes]} of this user's ddp_lesson runs alive now: processes whose
    DDP_LESSON_RUN_DIR names a run directory whose config.json holds the same token as
    their DDP_LESSON_RUN_TOKEN. A process that merely carries the variable is not ours."""
    groups, tokens = {}, {}
    for p in run_processes():
        try:
            env = p.environ()
        except psutil.Error:
            continue
        run_dir = os.path.abspath(env.get(rundir.ENV))
        if run_dir not in tokens:
            tokens[run_dir] = _config_token(run_dir)
        if tokens[run_dir] and env.get(rundir.TOKEN_ENV) == tokens[run_dir]:
            groups.setdefault(run_dir, []).append(p)
    return groups


def _config_token(run_dir):
    config = rundir.read_json(rundir.config(run_dir))
    return config.get("token") if isinstance(config, dict) else None


def kill_all(procs, sig=signal.SIGKILL):
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


def wait_gone(procs, timeout):
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return alive


def ranks(run_dir):
    """The ranks of a run alive now, from their pid files (logs/rank<R>.pid, "PID START" with
    START in clock ticks since boot): a warm rank is not a child of the agent."""
    found = []
    for f in sorted(rundir.logs(run_dir).glob("rank*.pid")):
        try:
            pid, ticks = f.read_text().split()
            p = psutil.Process(int(pid))
            started = psutil.boot_time() + int(ticks) / os.sysconf("SC_CLK_TCK")
            if abs(p.create_time() - started) < 0.05 and alive(p):
                found.append(p)
        except (OSError, ValueError, psutil.Error):
            continue
    return found


def end_tree(pid, grace=5.0, run_dir=None, token=None):
    """SIGTERM the root (torchrun tears its workers down), wait `grace` seconds, then
    SIGKILL whatever is left of the tree as it was and of the run's processes. Give the
    root as a psutil.Process where a reused PID must not be signalled."""
    procs = tree(pid)
    known = {p.pid: p for p in procs}
    if procs:
        kill_all(procs[:1], signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and alive(procs[0]):
            time.sleep(0.05)
            for p in tree(pid):  # workers may start while we wait
                known.setdefault(p.pid, p)
    leftovers = list(known.values()) + (run_processes(run_dir, token) if run_dir else [])
    kill_all(leftovers)
    return wait_gone(leftovers, timeout=5)


def process(pid):
    """A psutil.Process for `pid` (None if it is gone already)."""
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None
