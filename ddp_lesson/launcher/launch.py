"""Start a real torchrun process tree without blocking, supervise it, and clean up.

    run = launch.start("train.py", nproc=2, args=["--epochs", "1"])   # or launch.run(a spec.Spec)
    run.wait()         # -> result dict (also written to result.json)
    run.stop()         # SIGTERM, short grace, then SIGKILL of every process of the run

A Run is only the process handle. What the ranks write is read from run.run_dir: metric rows
and log tails by runs (runs.MetricsTail, runs.log_tail), live views by monitor.Monitor.

torchrun runs as `python -m torch.distributed.run` in its own session, under
ddp_lesson.rank.agent (ends it if this process dies); each rank runs under ddp_lesson.rank.guard.

Launches are warm by default: warm processes (ddp_lesson.rank.warm.server, one per local rank,
started ahead of need by warm_up()) that have imported torch fork the run's agent, which runs
that same torchrun, and each rank (the agent asks warm process R for rank R), so nobody
imports torch again. A launch is cold (a new interpreter for the agent and each rank, the CLI
torchrun of config["command"]) with cold=True, DDP_LESSON_COLD=1, over several nodes, or when
the warm process cannot serve it; config["launch"] says which, and why.
"""
import atexit
import importlib.metadata
import os
import platform
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from .. import BadInput, __version__
from . import devices, failures, interrupts, isolation, stacks, validate, warm
from ..rank import guard, procs, rundir
from ..rank.rundir import write_json
from .spec import Nodes, Spec, fields

SHUTDOWN_TIMEOUT_S = 2   # torchrun's wait between SIGTERM and SIGKILL of its workers
STOP_GRACE_S = 5.0       # our wait for torchrun itself before SIGKILL of everything
PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])

_live = set()

# What the launcher's own environment may hold but a fresh run must not inherit: a kernel
# started under torchrun or Slurm, or a shell where a tutorial exported MASTER_PORT, would
# otherwise turn the agent into "a rank" and mix its rendezvous with another one.
SCRUB = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
         "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
         "TORCH_NCCL_ASYNC_ERROR_HANDLING_RANK")
SCRUB_PREFIXES = ("TORCHELASTIC_", "PET_", "DDP_LESSON_RUN_", "DDP_LESSON_AGENT_", "DDP_LESSON_WARM_",
                  "DDP_LESSON_FORKED")


def clean_env(env):
    return {k: v for k, v in env.items() if k not in SCRUB and not k.startswith(SCRUB_PREFIXES)}


def base_env():
    """What every process of a launch starts from: this process's environment, cleaned, with
    this package importable and output unbuffered (a rank's print reaches its log at once)."""
    env = clean_env(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = python_path(os.environ.get("PYTHONPATH"))
    return env


def python_path(value):
    """A PYTHONPATH for a run's processes: this package's parent first (the ranks and the guard
    import this copy of ddp_lesson), then `value`. A PYTHONPATH in a launch's env replaces the
    kernel's, never the package's."""
    return os.pathsep.join(p for p in (PACKAGE_PARENT, value) if p)


# Processes are spawned from one long-lived thread: a parent-death signal is tied to the
# thread that forked, so a short-lived caller thread (a widget callback, say) must not be it.
# That thread also registers the run and starts its watcher, so an interrupt in the caller
# (which only the main thread receives) cannot leave an agent without either.
_requests = queue.Queue()


def _spawner():
    while True:
        req = _requests.get()
        try:
            req["box"].append(req["fn"]())
        except BaseException as e:  # handed back to the caller
            req["box"].append(e)
        req["ready"].set()
        if req["cancelled"]:
            _cancel(req)


def _cancel(req):
    """The caller was interrupted while its run was being started: stop that run."""
    with _spawn_lock:
        if req.get("cancel_done") or not req["box"]:
            return
        req["cancel_done"] = True
    run = req["box"][0]
    if isinstance(run, Run):
        threading.Thread(target=run.stop, name="ddp-lesson-cancel", daemon=True).start()


_spawn_thread = None
_spawn_lock = threading.Lock()


def _in_spawner(fn):
    global _spawn_thread
    with _spawn_lock:
        if _spawn_thread is None:
            _spawn_thread = threading.Thread(target=_spawner, name="ddp-lesson-spawner", daemon=True)
            _spawn_thread.start()
    req = {"fn": fn, "box": [], "ready": threading.Event(), "cancelled": False}
    try:
        with interrupts.Held():   # put() takes a Condition's lock in Python code
            _requests.put(req)
        interrupts.wait_for(req["ready"])
    except BaseException:
        req["cancelled"] = True  # the spawner checks this after it has set ready...
        if req["ready"].is_set():  # ...and this sees the case where it already had
            _cancel(req)
        raise
    if isinstance(req["box"][0], BaseException):
        raise req["box"][0]
    return req["box"][0]


COLD_ENV = "DDP_LESSON_COLD"   # "1": every launch is cold, as a CLI torchrun
WARM_NOTE = ("This launch was warm: its ranks were forked from processes that had imported torch. "
             "`--cold` (cold=True) starts each one as a new interpreter, as torchrun does.")
WARM_WAIT_S = 60               # how long a launch waits for a warm process that is starting
_warm = None
_warm_lock = threading.Lock()


def warm_up():
    """Start this launcher's warm process if it has none or a stale one, without waiting for
    it (it imports torch: a few seconds of one core). Call it ahead of need: a panel does when
    it is displayed. Returns the warm.Server, or None where launches are cold anyway."""
    global _warm
    if os.environ.get(COLD_ENV) or not sys.platform.startswith("linux"):
        return None
    env = base_env()
    with _warm_lock:
        old = _warm
        if old is not None and (not old.alive() or (old.hello and old.why_not(env))):
            _warm = None
        if _warm is None:
            _warm = _in_spawner(lambda: warm.Server(env))   # tied to the spawner thread, which lives on
        server = _warm
    if old is not None and old is not server:
        old.retire()   # its running runs finish first
    return server


def _warm_server(env, cold, nnodes, nproc=1):
    """(the warm processes to use, None) or (None, why this launch is cold)."""
    if cold:
        return None, "asked for (cold=True, --cold)"
    if os.environ.get(COLD_ENV):
        return None, f"{COLD_ENV} is set"
    if nnodes > 1:
        return None, "a run over several nodes starts its agents as a CLI torchrun does"
    server = warm_up()
    if server is None:
        return None, "warm launches need Linux (fork and prctl)"
    _in_spawner(lambda: server.grow(nproc))   # one warm process per local rank
    end = time.monotonic() + WARM_WAIT_S
    for s in (server, *server.peers):
        if not interrupts.wait_for(s.started, max(0.0, end - time.monotonic())):
            return None, f"the warm processes were not up within {WARM_WAIT_S} s"
    why = server.why_not(env)
    if why is not None:
        warm_up()   # replaces a stale one for the next launch
        return None, why
    return server, None


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


def _prepare_run_dir(run_dir, script):
    path = Path(run_dir) if run_dir else rundir.new_path(name=Path(script).stem)
    if path.exists() and not path.is_dir():
        raise BadInput(f"The run directory {path} is a file; give a folder that does not exist yet.")
    if path.is_dir() and any(path.iterdir()):
        raise BadInput(f"The run directory {path} is not empty; give a new folder so runs never mix.")
    try:
        return rundir.create(path)
    except FileExistsError:
        raise BadInput(f"The run directory {path} is already used by another run; give a new folder.") from None
    except OSError as e:
        raise BadInput(f"Cannot create the run directory {path}: {e.strerror}.") from None


def start(script, nproc=None, gpus=None, cpu=False, args=(), run_dir=None, max_restarts=0,
          timeout=None, env=None, label=None, nnodes=1, node_rank=0, rdzv_endpoint=None,
          rdzv_id=None, private_files=None, cold=False):
    """Launch `script` under torchrun and return a Run at once: run(Spec(...), run_dir) from
    keywords (spec.Spec says what each means). Bad input raises BadInput (one sentence)
    before anything starts."""
    return run(Spec(script, devices.Request(nproc, gpus, cpu), args=args, max_restarts=max_restarts,
                    timeout=timeout, env=env, label=label,
                    nodes=Nodes(nnodes, node_rank, rdzv_endpoint, rdzv_id),
                    private_files=private_files, cold=cold), run_dir)


def run(spec, run_dir=None):
    """Launch a spec.Spec under torchrun in `run_dir` (a new, empty folder; default: a new one
    under runs/) and return a Run at once. What only this machine can say (which GPUs exist,
    the run directory) raises BadInput, one sentence, before anything starts."""
    script, nodes = spec.script, spec.nodes
    plan = spec.devices.plan()
    user_env = dict(spec.env)
    if "PYTHONPATH" in user_env:
        user_env["PYTHONPATH"] = python_path(user_env["PYTHONPATH"])
    server, why_cold = _warm_server({**base_env(), **plan.env, **user_env}, spec.cold, nodes.count, plan.nproc)
    if server is not None:
        why_cold = warm.script_sets_start_vars(script, {**base_env(), **plan.env, **user_env})
        if why_cold:
            server = None
    path = _prepare_run_dir(run_dir, script)
    shutil.copyfile(script, rundir.script(path))
    for name, data in spec.private_files:
        rundir.write_bytes(path / name, data, private=True)

    rdzv = nodes.torchrun_args()
    token = secrets.token_hex(8)
    torchrun = ["-m", "torch.distributed.run", *rdzv,
                "--nproc-per-node", str(plan.nproc), "--max-restarts", str(spec.max_restarts),
                "--log-dir", str(rundir.torchrun_logs(path)), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
                "--monitor-interval", "0.1"]
    rank = ["--rank", str(rundir.script(path)), *spec.args]
    # the agent's arguments, warm or cold: the warm process adds --parent itself
    warm_args = ["--signal", "TERM", *torchrun, "-m", "ddp_lesson.rank.guard", *rank]
    private = isolation.for_run(nodes.count == 1, user_env)   # a network of its own (warm: the warm process's)
    cmd = private.wrap([sys.executable, "-m", "ddp_lesson.rank.agent", "--parent", str(os.getpid()), *warm_args])
    child_env = base_env()
    # the plan's OMP_NUM_THREADS (cores per rank) unless the launcher's environment sets one:
    # torchrun keeps what its caller set, and so does this
    child_env.update({k: v for k, v in plan.env.items() if not (k == "OMP_NUM_THREADS" and k in os.environ)})
    child_env.update({
        rundir.ENV: str(path),
        rundir.TOKEN_ENV: token,  # with the run dir, what identifies this run's processes
        "DDP_LESSON_SCRIPT_DIR": str(script.resolve().parent),
        guard.SCRIPT_ENV: str(script.resolve()),   # __file__ and argv[0] name it, as under torchrun
        "DDP_LESSON_BACKEND": plan.backend,
    })
    # torchrun >= 2.5 hands its rendezvous store to the ranks and keeps it across elastic
    # restarts, so a restarted rank can read the previous attempt's gloo/NCCL addresses and
    # fail ("connectFullMesh ... Connection refused") or hang (pytorch/pytorch#135712).
    # A fresh store per attempt, hosted by rank 0 on a free port, avoids that. Only where
    # restarts can happen: otherwise runs stay exactly as under plain torchrun.
    if spec.max_restarts > 0:
        child_env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    child_env.update(private.env)
    child_env.update(user_env)
    config = {
        **fields(spec, plan),
        "token": token, "versions": _versions(), "host": socket.gethostname(),
        # who supervises the run: `cleanup` spares runs whose launcher is still alive
        "launcher": {"pid": os.getpid(), "create_time": procs.create_time(os.getpid())},
        "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "start_unix": time.time(),
        "command": cmd,   # the cold launch; a warm one runs the same torchrun (see "launch")
        "torchrun": torchrun_line(plan.nproc, rdzv, spec.max_restarts, script.name, spec.args),
        "launch": {"mode": "warm" if server else "cold", "why": why_cold,
                   "warm_pid": server.pid if server else None},
        "isolation": private.config(),
    }
    write_json(rundir.config(path), config)
    warm_spawn = None
    if server is not None:
        warm_spawn = (server, warm_args, child_env)
    return Run(spec, path, cmd, child_env, config, warm_spawn)


def torchrun_line(nproc, rdzv, max_restarts, script_name, args):
    """The plain torchrun command a learner would type for this launch."""
    words = ["torchrun", *rdzv, f"--nproc-per-node={nproc}"]
    if max_restarts:
        words.append(f"--max-restarts={max_restarts}")
    return " ".join(words + [script_name, *args])


class Run:
    """The process handle of one launch: start, state, wait, stop. What the ranks write is
    read from run_dir (runs, monitor), not here. Safe to poll from a notebook's main thread.
    `spec` is the spec.Spec it was given, unchanged; `config` is what config.json records."""

    def __init__(self, spec, run_dir, cmd, env, config, warm_spawn=None):
        self.spec = spec
        self.run_dir = Path(run_dir)
        self.config = config
        self.timeout = spec.timeout
        self.token = config["token"]
        self.result = None
        self.proc = None
        self._done = threading.Event()
        self._stop_requested = False
        self._timed_out = False
        self._t0 = time.monotonic()
        _in_spawner(lambda: self._spawn(cmd, env, warm_spawn))

    def _spawn(self, cmd, env, warm_spawn):
        """In the spawner thread: the agent, its place in _live and its watcher, together."""
        self.proc = None
        if warm_spawn is not None:
            server, args, warm_env = warm_spawn
            try:
                self.proc = server.spawn(args, warm_env, os.getcwd(), rundir.agent_log(self.run_dir))
            except warm.Unavailable as e:   # cold after all, and config.json says so
                self.config = {**self.config, "launch": {"mode": "cold", "why": str(e), "warm_pid": None}}
                write_json(rundir.config(self.run_dir), self.config)
        if self.proc is None:
            with open(rundir.agent_log(self.run_dir), "wb") as agent_log:
                self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=agent_log,
                                             stderr=subprocess.STDOUT, start_new_session=True,
                                             cwd=os.getcwd())
        # held from the start (only our watcher reaps it), so a reused PID is never signalled
        self._agent = procs.process(self.proc.pid)
        _live.add(self)
        threading.Thread(target=self._watch, name="ddp-lesson-watch", daemon=True).start()
        return self

    # -- state ------------------------------------------------------------------------
    @property
    def pid(self):
        return self.proc.pid

    @property
    def status(self):
        return self.result["status"] if self.result else "running"

    @property
    def elapsed(self):
        """Seconds since the run started (until it ended, once it has)."""
        return self.result["duration_s"] if self.result else time.monotonic() - self._t0

    def done(self):
        return self._done.is_set()

    def wait_done(self, timeout=None):
        """Block up to `timeout` seconds (None: until the end); True if the run has ended.
        Unlike wait(), an interrupt here does not stop the run."""
        return interrupts.wait_for(self._done, timeout)

    def pids(self):
        """PIDs of the agent, its descendants, and the processes the run's pid files name with
        theirs (warm ranks are not the agent's children) alive now."""
        found = [p.pid for p in procs.tree(self._agent)]
        for rec in procs.recorded(self.run_dir):
            found += [p.pid for p in procs.tree(rec) if p.pid not in found]
        return found

    # -- control ----------------------------------------------------------------------
    def wait(self, timeout=None):
        """Block until the run ends (or `timeout` seconds pass: then None). An interrupt
        (Ctrl-C, the notebook's stop button) stops the run before it propagates."""
        try:
            if not interrupts.wait_for(self._done, timeout):
                return None
        except KeyboardInterrupt:
            self.stop()
            raise
        return self.result

    def stop(self, grace=STOP_GRACE_S):
        """End every process of the run; status becomes `interrupted` unless it had ended."""
        if not self._done.is_set():
            self._stop_requested = True
            procs.end_tree(self._agent, grace=grace, run_dir=self.run_dir, token=self.token)
            interrupts.wait_for(self._done, 30)
        return self.result

    # -- supervision (watch thread) ---------------------------------------------------
    def _watch(self):
        """Whatever happens here (a run directory deleted under us, a full disk), the run
        ends: every process of it is ended, and it gets a result and a message."""
        rc, where, error = None, None, None
        try:
            try:
                rc = self.proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                self._timed_out = not self._stop_requested
                if self._timed_out:
                    where = self._where_ranks_are()
                procs.end_tree(self._agent, grace=STOP_GRACE_S, run_dir=self.run_dir, token=self.token)
                rc = self.proc.wait()
        except BaseException as e:
            error = e
        try:
            # Nothing of the run may outlive it, whatever happened to the agent.
            procs.end_tree(self._agent, grace=0, run_dir=self.run_dir, token=self.token)
            if not isinstance(error, warm.Lost) and self.proc.poll() is None:
                rc = self.proc.wait()
            self._finish(rc, where, error)
        except BaseException as e:
            self.result = {"status": "failed", "returncode": rc, "duration_s": self.elapsed,
                           "message": f"Supervising the run failed ({type(e).__name__}: {e}); "
                                      f"every process of it was ended."}
        finally:
            _live.discard(self)
            self._done.set()

    def _where_ranks_are(self):
        """Ask each rank (the agent's children) for its Python stack, for the timeout message."""
        try:
            ranks = procs.ranks(self.run_dir)   # warm ranks are not the agent's children
        except Exception:
            return None
        procs.kill_all(ranks, signal.SIGUSR1)
        # each rank's stack is written by its signal handler; on a busy machine that can take a
        # while, so wait for every live rank's whole stack (up to a few seconds), not a fixed
        # pause: a stack read half written named a frame inside init_process_group as a collective
        nproc, end = self.config.get("nproc", 0), time.monotonic() + 5

        def whole(where):
            return len(where) >= min(nproc, len(ranks)) and all(w["complete"] for w in where.values())

        where = stacks.where(self.run_dir, nproc)
        while not whole(where) and time.monotonic() < end:
            time.sleep(0.1)
            where = stacks.where(self.run_dir, nproc)
        return where

    def _finish(self, rc, where=None, error=None):
        duration = round(time.monotonic() - self._t0, 3)
        if error is not None:
            status = "failed"
        elif self._timed_out:
            status = "timeout"
        elif self._stop_requested:
            status = "interrupted"
        else:
            status = "ok" if rc == 0 else "failed"
        result = {"status": status, "returncode": rc, "duration_s": duration}
        if error is not None:
            result["message"] = (f"Supervising the run failed ({type(error).__name__}: {error}); "
                                 f"every process of it was ended.")
        elif status == "failed":
            result["failure"] = failures.root_cause(self.run_dir)
            result["message"] = failures.describe(result["failure"])
        elif status == "timeout":
            result["message"] = failures.after_timeout(stacks.timeout_message(self.timeout, where),
                                                       self.config, where)
        elif status == "interrupted":
            result["message"] = "The run was stopped; every process of it has ended."
        if status in ("failed", "timeout") and self.config.get("launch", {}).get("mode") == "warm":
            result["message"] = result.get("message", "") + "\n" + WARM_NOTE
        self.result = result
        write_json(rundir.result(self.run_dir), result)

    def __repr__(self):
        return f"<Run {self.run_dir.name} {self.status}>"


@atexit.register
def _stop_all():
    for run in list(_live):
        run.stop(grace=2)
    if _warm is not None:
        _warm.stop()


if "ipykernel" in sys.modules:   # a notebook will launch: have torch imported by then
    warm_up()
