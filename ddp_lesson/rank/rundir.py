"""The run directory, one per launch (the contract in the README): the names of its files, the
environment variable that tells every process of a run where it is, a new directory's name,
its creation, and atomic JSON writes. Standard library only: ranks and the guard import it.

    config.json  script.py  result.json  model.pt (the lesson scripts' trained weights)
    torchrun/    torchrun's own --log-dir
    logs/        agent.log, agent.failures.json, rank<R>.stdout.log, rank<R>.stderr.log,
                 rank<R>.error.json, rank<R>.stack.log; agent.pid, rank<R>.pid, fork<PID>.pid
                 (how a run's processes are found, see write_pid)
    metrics/     rank<R>.jsonl
"""
import json
import os
import re
import secrets
import time
from pathlib import Path

ENV = "DDP_LESSON_RUN_DIR"        # every process of a run has it: the run directory's absolute path
RUNS_ENV = "DDP_LESSON_RUNS"      # where new run directories go, if set (a shared, read-only notebooks folder)
BASE = "runs"                     # else here, under the working folder
TOKEN_ENV = "DDP_LESSON_RUN_TOKEN"  # and this run's token, also in config.json (procs.py matches them)

CONFIG = "config.json"
SCRIPT = "script.py"
RESULT = "result.json"
LOGS = "logs"
METRICS = "metrics"
WORLD_KEY = "world.key"   # a live world's key: only its ranks can connect back to the kernel
MODEL = "model.pt"   # a lesson script's rank 0 saves model.module.state_dict() here at the end
# What the contract names in a run directory: a file a launch adds (spec.Spec's private_files) takes
# another name, so that it can neither clobber these nor be clobbered by them.
RESERVED = (CONFIG, SCRIPT, RESULT, LOGS, METRICS, MODEL)


def config(run_dir):
    return Path(run_dir) / CONFIG


def script(run_dir):
    return Path(run_dir) / SCRIPT


def result(run_dir):
    return Path(run_dir) / RESULT


def logs(run_dir):
    return Path(run_dir) / LOGS


def metrics(run_dir):
    return Path(run_dir) / METRICS


def torchrun_logs(run_dir):
    """torchrun's own --log-dir (its per-attempt folders), beside logs/."""
    return Path(run_dir) / "torchrun"


def agent_log(run_dir):
    return logs(run_dir) / "agent.log"


def agent_failures(run_dir):
    return logs(run_dir) / "agent.failures.json"


def rank_log(run_dir, rank, stream):
    """logs/rank<R>.<stream>.log, stream "stdout" or "stderr"."""
    return logs(run_dir) / f"rank{rank}.{stream}.log"


def error_file(run_dir, rank):
    return logs(run_dir) / f"rank{rank}.error.json"


def error_files(run_dir):
    """The rank<R>.error.json files in logs/, in name order."""
    return sorted(logs(run_dir).glob("rank*.error.json"))


def stack_file(run_dir, rank):
    return logs(run_dir) / f"rank{rank}.stack.log"


def pid_file(run_dir, name):
    """logs/<name>.pid: "PID START" of one process of the run (START: proc(5)'s starttime,
    clock ticks after boot, so that a later process given the same PID is not taken for it)."""
    return logs(run_dir) / f"{name}.pid"


def pid_files(run_dir):
    return sorted(logs(run_dir).glob("*.pid"))


def rank_pid_files(run_dir):
    """{rank: logs/rank<R>.pid} of the ranks that noted themselves."""
    found = {}
    for path in pid_files(run_dir):
        m = re.fullmatch(r"rank(\d+)\.pid", path.name)
        if m:
            found[int(m.group(1))] = path
    return found


def start_ticks(pid="self"):
    """When process `pid` started, in clock ticks after boot (field 22 of /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        data = f.read()
    return int(data[data.rindex(")") + 2:].split()[22 - 3])


def write_pid(run_dir, name):
    """Record this process in logs/<name>.pid: a process forked from another one shows that
    one's environment in /proc, so its DDP_LESSON_RUN_DIR cannot be how it is found."""
    try:
        with open(pid_file(run_dir, name), "w") as f:
            f.write(f"{os.getpid()} {start_ticks()}\n")
    except OSError:
        pass


def read_pid(path):
    """(pid, start ticks) from a pid file, None if it cannot be read."""
    try:
        pid, ticks = Path(path).read_text().split()
        return int(pid), int(ticks)
    except (OSError, ValueError):
        return None


def world_key(run_dir):
    """A live world's key (0600): only this world's ranks can connect back to the kernel."""
    return Path(run_dir) / WORLD_KEY


def metrics_file(run_dir, rank):
    return metrics(run_dir) / f"rank{rank}.jsonl"


def is_metrics_file(name):
    """True for a file name in metrics/ that holds a rank's rows."""
    return re.fullmatch(r"rank\d+\.jsonl", name) is not None


def rank_log_of(name):
    """(rank, stream) for a file name in logs/ like rank1.stderr.log, else None."""
    m = re.fullmatch(r"rank(\d+)\.(stdout|stderr)\.log", name)
    return (int(m.group(1)), m.group(2)) if m else None


def from_env(default=None):
    """This process's run directory (a Path), or `default` outside a ddp_lesson run."""
    value = os.environ.get(ENV)
    return Path(value) if value else default


def new_path(base=None, name="run"):
    """A fresh, not yet created path: <base>/<time>-<name>-<4 hex>; `base` by default
    $DDP_LESSON_RUNS, else runs/."""
    base = base or os.environ.get(RUNS_ENV) or BASE
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", name)[:40] or "run"
    return Path(base) / f"{time.strftime('%Y%m%d-%H%M%S')}-{stem}-{secrets.token_hex(2)}"


def private_dirs(path):
    """Make `path` and the parents it lacks, each readable by this user only (0700), whatever
    the umask: on a shared machine another user must not read a run's script, logs or token."""
    path = Path(path)
    missing = []
    while not path.exists():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for p in reversed(missing):
        try:
            p.mkdir(mode=0o700)
        except FileExistsError:
            continue   # made by another run meanwhile: left as it is
        os.chmod(p, 0o700)


def create(path):
    """Create the run directory (0700) with logs/ and metrics/ and return its absolute path.
    Raises FileExistsError when another run already claimed it (logs/ is the claim: only one
    creator can make it), NotADirectoryError or OSError otherwise."""
    path = Path(path)
    private_dirs(path)
    os.chmod(path, 0o700)   # also a given folder that existed (empty)
    logs(path).mkdir(mode=0o700)
    metrics(path).mkdir(mode=0o700, exist_ok=True)
    return path.resolve()


def read_json(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def write_json(path, data):
    """Atomic: readers never see half a file."""
    write_bytes(path, json.dumps(data, indent=2, default=str).encode())


def write_bytes(path, data, private=False):
    """Write `data` to `path` atomically, readable by this user only (0600: config.json holds
    the run's token). private: the file is created anew, whatever a stale temporary file had."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if private:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    else:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


ORPHANED = ("The run was ended because what launched it (a notebook's kernel, a terminal's "
            "command, a Jupyter server) ended during it.")


def record_orphaned(run_dir, now=None):
    """result.json for a run whose launcher died (a killed kernel, a stopped server), written by
    the run's agent on its way out. The launcher writes it otherwise: never overwrite one."""
    if not run_dir or result(run_dir).exists() or not config(run_dir).exists():
        return
    start = (read_json(config(run_dir), {}) or {}).get("start_unix")
    duration = round((now or time.time()) - start, 3) if isinstance(start, (int, float)) else None
    try:
        write_json(result(run_dir), {"status": "interrupted", "returncode": None, "duration_s": duration,
                                     "message": ORPHANED})
    except OSError:
        pass
