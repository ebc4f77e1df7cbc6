"""Pre-flight checks for a workshop (`python -m ddp_lesson doctor`) and `cleanup`.

One line per check: ok / warn / fail, with what to do."""
import importlib.metadata
import os
import platform
import re
import shutil
import signal
import socket
import stat
import sys
import tempfile
import time
from pathlib import Path

import psutil

from . import devices, isolation, launch, runs
from ..rank import procs, rundir
from ..rank.bundled import script
from ..rank.rundir import read_json, write_json

# The oldest torch the whole test suite passed on (requirements.txt and pyproject.toml say the
# same). Older releases lack what lessons use: DDP(forward_sync_buffers=...) in 03b and 04,
# FSDP2's fully_shard and torch.distributed.checkpoint's APIs in 10.
TORCH_FLOOR = (2, 14, 1)


def _line(level, text, out):
    print(f"{level:<5} {text}", file=out, flush=True)
    return level


def _version(pkg):
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def release(version):
    """(2, 14, 1) for "2.14.1+cpu" or "2.14.1a0"; a missing patch number counts as 0."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return tuple(int(g or 0) for g in m.groups()) if m else (0, 0, 0)


def torch_floor_line(version, out):
    """ok when `version` is at least TORCH_FLOOR, else a warning that says what will break."""
    floor = ".".join(map(str, TORCH_FLOOR))
    if release(version) >= TORCH_FLOOR:
        return _line("ok", f"torch {version} is at least {floor}, the oldest release the course was tested on", out)
    return _line("warn", f"torch {version} is older than {floor}, the oldest release the course was tested on: "
                         f"notebooks 03b, 04 and 10 use APIs it may lack; "
                         f"upgrade with `python -m pip install -r requirements.txt`", out)


def check_versions(out):
    import torch  # CUDA is not initialised by reading versions
    levels = [_line("ok", f"python {platform.python_version()}, torch {torch.__version__}, "
                          f"torchvision {_version('torchvision') or 'missing'}", out)]
    levels.append(torch_floor_line(torch.__version__, out))
    cuda = torch.version.cuda
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else None
    except Exception:  # a CPU build has no NCCL
        nccl = None
    levels.append(_line("ok", f"CUDA build {cuda or 'none (CPU-only torch)'}, NCCL {nccl or 'none'}, "
                              f"distributed {'available' if torch.distributed.is_available() else 'MISSING'}",
                        out))
    if not torch.distributed.is_available():
        levels.append(_line("fail", "torch.distributed is not available: install a regular PyTorch build", out))
    return levels


def check_gpus(out):
    gpus = devices.list_gpus()
    if not gpus:
        return [_line("ok", "no NVIDIA GPU (or no driver): lessons run as CPU processes on gloo", out)]
    levels = []
    for g in gpus:
        if g.busy:
            pids = ", ".join(str(p) for p, _ in g.processes)
            levels.append(_line("warn", f"{g.label()}: busy (pids {pids}); pick another GPU or "
                                        f"end those processes (`python -m ddp_lesson cleanup` for ours)", out))
        else:
            levels.append(_line("ok", g.label(), out))
    return levels


def check_host(out):
    levels = []
    cores = devices.cpu_count()
    levels.append(_line("ok" if cores >= 2 else "warn",
                        f"{cores} CPU core(s) available" + ("" if cores >= 2 else
                        ": 2 CPU ranks will share one core; runs will be slow"), out))
    if os.path.isdir("/dev/shm"):
        shm = shutil.disk_usage("/dev/shm").total / 2 ** 30
        levels.append(_line("ok" if shm >= 1 else "warn", f"/dev/shm {shm:.1f} GiB" + ("" if shm >= 1 else
                            ": DataLoader workers and NCCL need more; in Docker use --shm-size=8g"), out))
    try:
        port = launch.free_port()
        levels.append(_line("ok", f"a free rendezvous port on 127.0.0.1 (e.g. {port}); runs never "
                                  f"use a fixed port", out))
    except OSError as e:
        levels.append(_line("fail", f"cannot bind a port on 127.0.0.1 ({e}); check the loopback interface", out))
    left = [p for run_dir, ps in procs.by_run().items() if supervisor(run_dir) is None for p in ps]
    if left:
        levels.append(_line("warn", f"{len(left)} process(es) of earlier ddp_lesson runs are still alive: "
                                    f"run `python -m ddp_lesson cleanup`", out))
    else:
        levels.append(_line("ok", "no leftover processes of ddp_lesson runs", out))
    return levels


COURSE_COMMANDS = ("ddp_lesson.rank.agent", "ddp_lesson.rank.guard", "ddp_lesson.rank.warm.server", "torch.distributed.run", "torchrun")


def other_users():
    """{uid: processes} of other users running this course's processes (a run, a warm process):
    their command lines are visible, their environments are not."""
    me, found = os.getuid(), {}
    for p in psutil.process_iter(["uids", "cmdline"]):
        try:
            uid, cmd = p.info["uids"].real, " ".join(p.info["cmdline"] or ())
        except (psutil.Error, AttributeError, TypeError):
            continue
        if uid != me and any(c in cmd for c in COURSE_COMMANDS):
            found[uid] = found.get(uid, 0) + 1
    return found


def check_sharing(out):
    """On a shared machine (a classroom server): who else runs the course here, this
    learner's fair share of its cores and memory, and how busy it is now."""
    others = other_users()
    cores, users = devices.cpu_count(), 1 + len(others)
    mem = psutil.virtual_memory()
    share_cores, share_mem = cores / users, mem.total / users / 2 ** 30
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    who = (f"{len(others)} other user(s) have ddp_lesson runs or warm processes here" if others
           else "no other user has ddp_lesson runs here now")
    text = (f"{who}; your fair share: about {share_cores:.1f} core(s) and {share_mem:.1f} GiB of memory "
            f"(load {load:.1f} on {cores} core(s), {mem.available / 2 ** 30:.1f} GiB free)")
    if others and share_cores < 2:
        return [_line("warn", text + ": 2 CPU ranks will share cores with the others; runs will be slower, "
                                     "not wrong", out)]
    return [_line("ok", text, out)]


def check_store(out):
    """Where a --standalone run's rendezvous store listens. torch (checked up to 2.14) binds
    its TCPStore server to every interface whatever host it is given, and torchrun offers no
    setting to change that, so the launcher cannot keep it on loopback. A run in a private
    network (isolation.py) has no interface but its own loopback; elsewhere: say so."""
    private = isolation.status()
    if private.isolated:
        return [_line("ok", f"{private.line()} (its rendezvous store included)", out)]
    _line("warn", private.line(), out)
    import torch.distributed as dist
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    try:
        port = store.port
        bound = sorted({c.laddr.ip for c in psutil.Process().net_connections("tcp")
                        if c.status == psutil.CONN_LISTEN and c.laddr.port == port})
    finally:
        del store
    if bound and all(ip in ("127.0.0.1", "::1") for ip in bound):
        return ["warn", _line("ok", "the rendezvous store of a single-node run listens on loopback only", out)]
    return ["warn", _line("warn", f"the rendezvous store of a single-node run listens on all interfaces "
                          f"({', '.join(bound) or '?'}, a free port per run; torch offers no loopback "
                          f"setting): on a shared server firewall it off (docs/instructors.md)", out)]


def check_allreduce(out, timeout=120):
    """The smoke test: a real 2-rank run of allreduce_check.py. Its folder is removed when it
    passes and kept when it fails, and the failing rank's traceback and stderr are shown."""
    gpus = devices.list_gpus()
    kwargs = {"nproc": min(2, len(gpus))} if gpus else {"nproc": 2, "cpu": True}
    tmp = Path(tempfile.mkdtemp(prefix="ddp-lesson-doctor-"))
    run = launch.start(script("allreduce_check.py"), run_dir=tmp / "run",
                       timeout=timeout, label="doctor", **kwargs)
    result = run.wait()
    if result["status"] == "ok":
        said = (read_json(Path(run.run_dir) / "allreduce.json") or {}).get("said", "")   # rank 0's sum, checked
        shutil.rmtree(tmp, ignore_errors=True)
        return [_line("ok", f"2-rank all_reduce smoke test passed in {result['duration_s']:.1f} s"
                            + (f": {said}" if said else ""), out)]
    message = (result.get("message") or "").strip()
    rank = (result.get("failure") or {}).get("rank")
    levels = [_line("fail", f"2-rank all_reduce smoke test {result['status']}: "
                            f"{message.splitlines()[0] if message else ''} (its files are kept in {run.run_dir})", out)]
    for line in message.splitlines()[1:]:
        print(f"      {line}", file=out)
    if rank is not None:
        tail = runs.log_tail(run.run_dir, rank, 20, "stderr").rstrip()
        if tail:
            print(f"      rank {rank}'s stderr, last lines:", file=out)
            for line in tail.splitlines():
                print(f"      {line}", file=out)
    return levels


def main(out=sys.stdout):
    print(f"ddp_lesson doctor on {socket.gethostname()} ({platform.platform()})", file=out)
    levels = []
    for check in (check_versions, check_gpus, check_host, check_sharing, check_store, check_allreduce):
        try:
            levels += check(out)
        except Exception as e:  # a broken check must not hide the others
            levels.append(_line("fail", f"{check.__name__} crashed: {type(e).__name__}: {e}", out))
    fails, warns = levels.count("fail"), levels.count("warn")
    print(f"{fails} failure(s), {warns} warning(s)", file=out)
    return 1 if fails else 0


def supervisor(run_dir):
    """The PID of the process that launched the run (a notebook kernel, a terminal) while
    it lives, else None."""
    launcher = (read_json(rundir.config(run_dir), {}) or {}).get("launcher") or {}
    alive = procs.is_alive(launcher.get("pid"), launcher.get("create_time"))
    return launcher["pid"] if alive else None


def cleanup(dry_run=False, everything=False, out=sys.stdout, grace=3.0):
    """End the leftover processes of this user's ddp_lesson runs (found by the
    DDP_LESSON_RUN_DIR in their environment; nothing else is touched). A run whose
    launcher is still alive is not a leftover and is spared, unless everything=True."""
    by_run = procs.by_run()
    if not everything:
        for run_dir in list(by_run):
            pid = supervisor(run_dir)
            if pid is not None:
                print(f"sparing run {run_dir}: its launcher (pid {pid}) still supervises it "
                      f"(use --all to end it too)", file=out)
                del by_run[run_dir]
    found = [p for ps in by_run.values() for p in ps]
    warm = [p for p, (pid, started) in procs.warm_processes().items()
            if everything or not procs.is_alive(pid, started)]
    for p in warm:
        print(f"{'would end' if dry_run else 'ending'} pid {p.pid}: a warm process whose launcher "
              f"{'is gone' if not everything else 'may still use it'}", file=out)
    if not dry_run and warm:
        procs.kill_all(warm)
        procs.wait_gone(warm, 5)
    if not found:
        if not warm:
            print("no leftover processes of ddp_lesson runs", file=out)
        stale_folders(dry_run, out)
        return 0
    for run_dir, ps in sorted(by_run.items()):
        for p in ps:
            try:
                what = " ".join(p.cmdline()[-3:])
            except psutil.Error:
                what = "?"
            print(f"{'would end' if dry_run else 'ending'} pid {p.pid} of run {run_dir}: ...{what}", file=out)
    if dry_run:
        return 0
    procs.kill_all(found, signal.SIGTERM)
    alive = procs.wait_gone(found, grace)
    procs.kill_all(alive)
    procs.wait_gone(alive, 5)
    for run_dir in by_run:
        if run_dir and rundir.config(run_dir).exists() and not rundir.result(run_dir).exists():
            write_json(rundir.result(run_dir), {"status": "interrupted", "returncode": None,
                                                "duration_s": None,
                                                "message": "Ended by `python -m ddp_lesson cleanup`."})
    print(f"ended {len(found)} process(es) of {len(by_run)} run(s)", file=out)
    stale_folders(dry_run, out)
    return 0


TEMP_PREFIXES = ("ddp-lesson-warm-", "ddp-lesson-door-", "torchelastic_")
SOCKETS = {"ddp-lesson-warm-": "sock", "ddp-lesson-door-": "door"}   # who listens in each folder
STALE_AFTER_S = 60       # younger folders may belong to a launch that is starting
NO_SOCKET_AFTER_S = 600  # a warm process importing torch, a world starting, has not bound its socket yet
TORCH_STALE_AFTER_S = 3600   # torch's own log folders: nothing says which run they belong to


def stale_folders(dry_run=False, out=sys.stdout, now=None, tmp=None):
    """Remove this user's folders in the temporary directory that nothing uses any more: a warm
    process's (left by a SIGKILLed kernel) or a live world's door, whose socket nobody listens
    on; torch's torchelastic_* log folders, untouched for an hour while no run of ours lives.
    Whether a socket is listened on is asked of the socket itself, not of the processes this
    process can see (cleanup may run in a PID namespace of its own). Another user's folders are
    never touched."""
    tmp = Path(tmp or tempfile.gettempdir())
    now = now or time.time()
    removed = []
    for path in sorted(tmp.iterdir()):
        prefix = next((p for p in TEMP_PREFIXES if path.name.startswith(p)), None)
        if prefix is None:
            continue
        try:
            st = path.lstat()
        except OSError:
            continue
        age = now - st.st_mtime
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or age < STALE_AFTER_S:
            continue
        if prefix in SOCKETS:
            listening = _listening(path / SOCKETS[prefix])
            if listening or (listening is None and age < NO_SOCKET_AFTER_S):
                continue
        elif age < TORCH_STALE_AFTER_S or _a_run_lives():
            continue
        print(f"{'would remove' if dry_run else 'removing'} {path}: a stale folder of an earlier run", file=out)
        if not dry_run:
            shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _listening(path):
    """True if a process listens on the Unix socket `path`, False if none does, None if there
    is no socket there."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect(str(path))
        return True
    except FileNotFoundError:
        return None
    except ConnectionRefusedError:
        return False
    except OSError:
        return True   # a socket we cannot judge: leave it
    finally:
        s.close()


def _a_run_lives():
    """Does a process of any ddp_lesson run of this user live (as far as this process sees)?"""
    return bool(procs.by_run())
