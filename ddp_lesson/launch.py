"""Start a real torchrun process tree without blocking, supervise it, and clean up.

    run = launch.start("train.py", nproc=2, args=["--epochs", "1"])
    run.metrics()      # new metric rows since the last call
    run.wait()         # -> result dict (also written to result.json)
    run.stop()         # SIGTERM, short grace, then SIGKILL of every process of the run

torchrun runs as `python -m torch.distributed.run` in its own session, under
ddp_lesson.guard (ends it if this process dies); each rank runs under the guard too.
"""
import atexit
import importlib.metadata
import os
import platform
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import BadInput, __version__, devices, failures, procs
from .runs import LogTail, MetricsTail, new_run_dir, tail_text, write_json

SHUTDOWN_TIMEOUT_S = 2   # torchrun's wait between SIGTERM and SIGKILL of its workers
STOP_GRACE_S = 5.0       # our wait for torchrun itself before SIGKILL of everything
PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)

_live = set()


# Processes are spawned from one long-lived thread: a parent-death signal is tied to the
# thread that forked, so a short-lived caller thread (a widget callback, say) must not be it.
_requests = queue.Queue()


def _spawner():
    while True:
        args, kwargs, box = _requests.get()
        try:
            box.append(subprocess.Popen(*args, **kwargs))
        except BaseException as e:  # handed back to the caller
            box.append(e)
        _requests.task_done()


_spawn_thread = None
_spawn_lock = threading.Lock()


def _popen(*args, **kwargs):
    global _spawn_thread
    with _spawn_lock:
        if _spawn_thread is None:
            _spawn_thread = threading.Thread(target=_spawner, name="ddp-lesson-spawner", daemon=True)
            _spawn_thread.start()
        box = []
        _requests.put((args, kwargs, box))
        _requests.join()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def _versions():
    out = {"python": platform.python_version(), "ddp_lesson": __version__}
    for pkg in ("torch", "torchvision"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def free_port(host="127.0.0.1"):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _check_number(name, value, minimum, allow_none=False, kind=int):
    if value is None and allow_none:
        return None
    try:
        number = kind(value)
        if kind is int and str(value).strip() != str(number) and not isinstance(value, int):
            raise ValueError
    except (TypeError, ValueError):
        raise BadInput(f"{name} must be a number, got {value!r}.") from None
    if number < minimum:
        raise BadInput(f"{name} must be at least {minimum}, got {number}.")
    return number


def _prepare_run_dir(run_dir, script):
    path = Path(run_dir) if run_dir else new_run_dir(name=Path(script).stem)
    if path.exists() and not path.is_dir():
        raise BadInput(f"The run directory {path} is a file; give a folder that does not exist yet.")
    if path.is_dir() and any(path.iterdir()):
        raise BadInput(f"The run directory {path} is not empty; give a new folder so runs never mix.")
    try:
        (path / "logs").mkdir(parents=True, exist_ok=True)
        (path / "metrics").mkdir(exist_ok=True)
    except OSError as e:
        raise BadInput(f"Cannot create the run directory {path}: {e.strerror}.") from None
    return path.resolve()


def start(script, nproc=None, gpus=None, cpu=False, args=(), run_dir=None, max_restarts=0,
          timeout=None, env=None, label=None, nnodes=1, node_rank=0, rdzv_endpoint=None,
          rdzv_id=None):
    """Launch `script` under torchrun and return a Run at once. Bad input raises
    BadInput (one sentence) before anything starts."""
    script = Path(script)
    if not script.is_file():
        raise BadInput(f"The script {script} does not exist." if not script.exists()
                       else f"The script {script} is not a file.")
    max_restarts = _check_number("--max-restarts", max_restarts, 0)
    timeout = _check_number("--timeout", timeout, 0.001, allow_none=True, kind=float)
    nnodes = _check_number("--nnodes", nnodes, 1)
    node_rank = _check_number("--node-rank", node_rank, 0)
    if node_rank >= nnodes:
        raise BadInput(f"--node-rank must be below --nnodes ({nnodes}), got {node_rank}.")
    if nnodes > 1 and not rdzv_endpoint:
        raise BadInput("A run over several nodes needs --rdzv-endpoint HOST:PORT (node 0's address).")
    args = [str(a) for a in args]
    plan = devices.plan(nproc=nproc, gpus=gpus, cpu=cpu)
    path = _prepare_run_dir(run_dir, script)
    shutil.copyfile(script, path / "script.py")

    if nnodes == 1:
        rdzv = ["--standalone"]
    else:
        rdzv = ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", str(rdzv_id or "ddp-lesson")]
    cmd = [sys.executable, "-m", "ddp_lesson.guard", "--signal", "TERM",
           "-m", "torch.distributed.run", *rdzv,
           "--nproc-per-node", str(plan.nproc), "--max-restarts", str(max_restarts),
           "--log-dir", str(path / "torchrun"), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
           "--monitor-interval", "0.1",
           "-m", "ddp_lesson.guard", str(path / "script.py"), *args]
    child_env = dict(os.environ)
    child_env.update(plan.env)
    child_env.update({
        "DDP_LESSON_RUN_DIR": str(path),
        "DDP_LESSON_SCRIPT_DIR": str(script.resolve().parent),
        "DDP_LESSON_BACKEND": plan.backend,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (PACKAGE_PARENT, os.environ.get("PYTHONPATH")) if p),
    })
    # torchrun >= 2.5 hands its rendezvous store to the ranks and keeps it across elastic
    # restarts, so a restarted rank can read the previous attempt's gloo/NCCL addresses and
    # fail ("connectFullMesh ... Connection refused") or hang (pytorch/pytorch#135712).
    # A fresh store per attempt, hosted by rank 0 on a free port, avoids that. Only where
    # restarts can happen: otherwise runs stay exactly as under plain torchrun.
    if max_restarts > 0:
        child_env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    child_env.update({k: str(v) for k, v in (env or {}).items()})
    config = {
        "script": str(script.resolve()), "args": args, "label": label or script.stem,
        "nproc": plan.nproc, "devices": plan.gpus or "cpu", "backend": plan.backend,
        "world_size": plan.nproc * nnodes, "nnodes": nnodes, "node_rank": node_rank,
        "rdzv_endpoint": rdzv_endpoint, "max_restarts": max_restarts, "timeout": timeout,
        "env": {k: child_env[k] for k in sorted(set(plan.env) | set(env or {}))},
        "versions": _versions(), "host": socket.gethostname(),
        # who supervises the run: `cleanup` spares runs whose launcher is still alive
        "launcher": {"pid": os.getpid(), "create_time": procs.create_time(os.getpid())},
        "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "start_unix": time.time(),
        "command": cmd,
    }
    write_json(path / "config.json", config)
    return Run(path, cmd, child_env, config, timeout)


class Run:
    """Handle on one launch. Safe to poll from a notebook's main thread."""

    def __init__(self, run_dir, cmd, env, config, timeout):
        self.run_dir = Path(run_dir)
        self.config = config
        self.timeout = timeout
        self.rows = []
        self.result = None
        self._metrics = MetricsTail(run_dir)
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._stop_requested = False
        self._timed_out = False
        self._t0 = time.monotonic()
        with open(self.run_dir / "logs" / "agent.log", "wb") as agent_log:
            self.proc = _popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=agent_log,
                               stderr=subprocess.STDOUT, start_new_session=True,
                               cwd=os.getcwd())
        _live.add(self)
        threading.Thread(target=self._watch, name="ddp-lesson-watch", daemon=True).start()

    # -- state ------------------------------------------------------------------------
    @property
    def pid(self):
        return self.proc.pid

    @property
    def status(self):
        return self.result["status"] if self.result else "running"

    def done(self):
        return self._done.is_set()

    def pids(self):
        """PIDs of the agent and its descendants alive now."""
        return [p.pid for p in procs.tree(self.proc.pid)]

    # -- reading back -----------------------------------------------------------------
    def metrics(self):
        """Metric rows written since the last call (all ranks, ordered by time)."""
        new = self._metrics.read()
        self.rows.extend(new)
        return new

    def log_tail(self, rank=0, lines=20, stream="stdout"):
        return tail_text(self.run_dir / "logs" / f"rank{rank}.{stream}.log", lines)

    def output(self, ranks=None):
        """A LogTail over the ranks' stdout/stderr, for following them live."""
        return LogTail(self.run_dir, ranks=ranks)

    # -- control ----------------------------------------------------------------------
    def wait(self, timeout=None, poll=0.1):
        """Block until the run ends (or `timeout` seconds pass: then None). An interrupt
        (Ctrl-C, the notebook's stop button) stops the run before it propagates."""
        end = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._done.wait(poll):
                if end is not None and time.monotonic() >= end:
                    return None
        except KeyboardInterrupt:
            self.stop()
            raise
        return self.result

    def stop(self, grace=STOP_GRACE_S):
        """End every process of the run; status becomes `interrupted` unless it had ended."""
        if not self._done.is_set():
            self._stop_requested = True
            procs.end_tree(self.proc.pid, grace=grace, run_dir=self.run_dir)
            self._done.wait(30)
        return self.result

    # -- supervision (watch thread) ---------------------------------------------------
    def _watch(self):
        remaining = None if self.timeout is None else self.timeout
        try:
            rc = self.proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            self._timed_out = not self._stop_requested
            procs.end_tree(self.proc.pid, grace=STOP_GRACE_S, run_dir=self.run_dir)
            rc = self.proc.wait()
        # Nothing of the run may outlive it, whatever happened to the agent.
        procs.kill_all(procs.run_processes(self.run_dir))
        self._finish(rc)

    def _finish(self, rc):
        duration = round(time.monotonic() - self._t0, 3)
        if self._timed_out:
            status = "timeout"
        elif self._stop_requested:
            status = "interrupted"
        else:
            status = "ok" if rc == 0 else "failed"
        result = {"status": status, "returncode": rc, "duration_s": duration}
        if status == "failed":
            result["failure"] = failures.root_cause(self.run_dir)
            result["message"] = failures.describe(result["failure"])
        elif status == "timeout":
            result["message"] = (f"The run did not finish within its {self.timeout:g} s timeout and "
                                 f"was stopped; a rank may be waiting in a collective that another "
                                 f"rank never reached.")
        elif status == "interrupted":
            result["message"] = "The run was stopped; every process of it has ended."
        write_json(self.run_dir / "result.json", result)
        self.result = result
        _live.discard(self)
        self._done.set()

    def __repr__(self):
        return f"<Run {self.run_dir.name} {self.status}>"


def live_runs():
    return list(_live)


@atexit.register
def _stop_all():
    for run in list(_live):
        run.stop(grace=2)
