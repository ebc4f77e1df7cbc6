"""Finding and ending the processes of a run, by identity, never by name: the tree under
torchrun; the run's identity a process started by exec carries in its environment
(DDP_LESSON_RUN_DIR and the per-run DDP_LESSON_RUN_TOKEN, also kept in config.json); the pid
files in the run's logs/ ("PID START": each guarded process, and each process a forked rank
forks, notes itself there), and a warm process's note of what it forked; and everything
below those."""
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
    """This user's processes of the run at run_dir (of every run if None), except this one and
    its ancestors: those whose environment names the run (DDP_LESSON_RUN_DIR, and
    DDP_LESSON_RUN_TOKEN equal to token if given: a process started by exec carries them),
    those its pid files name (logs/*.pid: the agent, the ranks, what a forked rank forked), those
    a warm process forked for it, and every descendant of these."""
    return list(_found(run_dir, token))


def _found(run_dir=None, token=None, verify=False):
    """{process: its run directory} (see run_processes). verify: a process found by its
    environment counts only if its token is the one in its run directory's config.json."""
    try:
        skip = {p.pid for p in psutil.Process().parents()} | {os.getpid()}
    except psutil.Error:
        skip = {os.getpid()}
    want = os.path.abspath(run_dir) if run_dir else None
    found, tokens = {}, {}

    def ours(d, t):
        if want is not None and d != want:
            return False
        if token is not None:
            return t == token
        if verify:
            if d not in tokens:
                tokens[d] = _config_token(d)
            return tokens[d] is not None and t == tokens[d]
        return True

    servers = []
    for p in _mine():
        try:
            env = p.environ()
        except psutil.Error:
            continue
        value = env.get(rundir.ENV)
        if value and ours(os.path.abspath(value), env.get(rundir.TOKEN_ENV)):
            found[p] = os.path.abspath(value)
        if env.get(FOR_ENV):
            servers.append(p)
    for p, d, t in warm_children(servers):
        if ours(d, t):
            found[p] = d
    for d in {want} if want else set(found.values()):
        for p in recorded(d):
            found.setdefault(p, d)
    for p, d in list(found.items()):
        try:
            for child in p.children(recursive=True):
                found.setdefault(child, d)
        except psutil.Error:
            continue
    return {p: d for p, d in found.items() if p.pid not in skip and alive(p)}


def recorded(run_dir):
    """The processes the run's pid files name (logs/*.pid) alive now: a pid whose process
    started at another moment is a later process given the same number, not the run's."""
    return [p for f in rundir.pid_files(run_dir) for p in recorded_file(f)]


def warm_children(servers=None):
    """[(process, run directory, token)] of the processes this user's warm processes (`servers`,
    by default all) forked and still run: a warm process notes each in its folder (warm.server:
    <pid>.run), since a fork shows its warm process's environment, not the run's."""
    found = []
    for server in warm_processes() if servers is None else servers:
        try:
            cmd = server.cmdline()
            folder = os.path.dirname(cmd[cmd.index("--parent") + 2])
            children = server.children()
        except (psutil.Error, ValueError, IndexError):
            continue
        for child in children:
            note = rundir.read_json(os.path.join(folder, f"{child.pid}.run"))
            try:
                if note["run_dir"] and rundir.start_ticks(child.pid) == note["start"]:
                    found.append((child, os.path.abspath(note["run_dir"]), note.get("token")))
            except (TypeError, KeyError, OSError, ValueError):
                continue
    return found


def warm_processes():
    """{process: (launcher pid, launcher start time)} of this user's warm processes (the
    ones warm launches fork from), found by the variable each carries in its environment;
    and the processes forked from one, which show its environment."""
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


def by_run(verify=True):
    """{run_dir: [processes]} of this user's ddp_lesson runs alive now (run_processes). A
    process whose environment merely carries DDP_LESSON_RUN_DIR is not ours: its token must be
    the one in that run directory's config.json (unless verify=False)."""
    groups = {}
    for p, d in _found(verify=verify).items():
        groups.setdefault(d, []).append(p)
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
    """The ranks of a run alive now, from their pid files (logs/rank<R>.pid): a warm rank is
    not a child of the agent."""
    return [p for f in rundir.rank_pid_files(run_dir).values() for p in recorded_file(f)]


def recorded_file(path):
    """[the process] a pid file names, if it is alive and started when the file says; else []."""
    entry = rundir.read_pid(path)
    try:
        p = psutil.Process(entry[0])
        if rundir.start_ticks(p.pid) == entry[1] and alive(p):
            return [p]
    except (TypeError, OSError, ValueError, psutil.Error):
        pass
    return []


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
