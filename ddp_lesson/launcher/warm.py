"""The launcher's side of warm launches: one warm process per local rank (ddp_lesson.rank.warm.server,
each its own interpreter), started ahead of need, checked before every launch; the first is
asked for each run's torchrun agent, which asks warm process R for rank R (rank.warm.ranks).

    server = warm.Server(env)        # from a long-lived thread: the processes die with that thread's process
    server.ready(timeout)            # True once they have imported torch and said hello
    server.retire()                  # replaced: its running runs finish, then it exits
    server.why_not(env)              # None, or the sentence saying why this launch must be cold
    agent = server.spawn(args, env, cwd, log)   # agent.pid, agent.wait(timeout), agent.poll()

A launch goes cold (a new interpreter for the agent and every rank, as a CLI torchrun) when
the warm process is not up, is stale, or the launch's environment differs in a variable
that torch or Python read at start-up, which a forked process cannot read again.
"""
import ast
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from . import isolation
from ..rank import procs
from ..rank.procs import FOR_ENV
from ..rank.warm.ranks import PATHS_ENV, Child as Agent, Lost, Unavailable, request
from ..rank.warm.server import fingerprint

# read when Python or torch start (TORCH_DISTRIBUTED_DEBUG when torch.distributed is imported,
# TORCH_LOGS when torch is): a process forked from one started with other values would not be
# what the launch asked for. Any TORCH*/PYTORCH_ variable counts, but for the few read later,
# when a process group or a rendezvous is made. OMP_NUM_THREADS is applied again in each rank.
START_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONSAFEPATH", "PYTHONNOUSERSITE",
             "PYTHONWARNINGS", "PYTHONDONTWRITEBYTECODE", "PYTHONOPTIMIZE", "PYTHONFAULTHANDLER",
             "PYTHONDEVMODE", "PYTHONUTF8", "PYTHONIOENCODING", "PYTHONMALLOC", "PYTHONINSPECT",
             "PYTHONVERBOSE", "PYTHONUSERBASE", "PYTHONPLATLIBDIR", "PYTHONSTARTUP",
             "LD_PRELOAD", "LD_LIBRARY_PATH", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
             "LOGLEVEL")   # LOGLEVEL: torch.distributed.elastic's logger
# OMP_* (libgomp reads them when it loads), but OMP_NUM_THREADS, which each rank applies again
START_PREFIXES = ("TORCH", "PYTORCH_", "KMP_", "GOMP_", "OMP_", "MKL_", "MALLOC_", "CUDA_MODULE_")
NOT_AT_START = ("OMP_NUM_THREADS",)
READ_LATER = ("TORCH_NCCL_", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
REPLY_TIMEOUT_S = 10
# an idle warm process exits after this many seconds (0: never): an idle learner then holds no
# torch; the next launch starts them again, and waits for that (a few seconds)
IDLE_ENV = "DDP_LESSON_WARM_IDLE_S"
IDLE_S = 15 * 60
PEER_GRACE_S = 60   # warm processes 1, 2, ... wait this much longer, so an agent that warm process 0
                    # forked just before its idle end still finds them (else its rank starts cold)


def idle_seconds(environ=None):
    value = (os.environ if environ is None else environ).get(IDLE_ENV, "").strip()
    try:
        return float(value) if value else IDLE_S
    except ValueError:
        return IDLE_S


def start_vars(env):
    return {k: v for k, v in env.items()
            if (k in START_ENV or k.startswith(START_PREFIXES)) and not k.startswith(READ_LATER)
            and k not in NOT_AT_START}


# what a warm process starts with where the launcher sets nothing: threads waiting for work
# sleep (libgomp reads it when torch loads it). With one thread per CPU rank it changes nothing;
# a script that sets it (gpt_ddp.py, as tutorials do) gets what it asked for, warm too
WARM_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}


def _env_sets(script):
    """[(NAME, value or None)] the script sets in os.environ, literally (None: not a literal)."""
    try:
        tree = ast.parse(Path(script).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return []
    out = []

    def const(node):
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    def is_environ(node):
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Subscript) and is_environ(t.value) and const(t.slice):
                    out.append((const(t.slice), const(node.value)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if f.attr == "setdefault" and is_environ(f.value) and node.args and const(node.args[0]):
                out.append((const(node.args[0]), const(node.args[1]) if len(node.args) > 1 else None))
            elif f.attr == "putenv" and node.args and const(node.args[0]):
                out.append((const(node.args[0]), None))
            elif f.attr == "update" and is_environ(f.value):
                for arg in node.args:
                    if isinstance(arg, ast.Dict):
                        out += [(const(k), None) for k in arg.keys if k is not None and const(k)]
                out += [(k.arg, None) for k in node.keywords if k.arg]
    return out


def script_sets_start_vars(script, env):
    """None, or why a warm launch of `script` with `env` would differ: the script sets a
    variable torch or Python read when they start (tutorials set TORCH_DISTRIBUTED_DEBUG and
    OMP_NUM_THREADS before `import torch`), to a value a warm process did not start with."""
    started = {**WARM_DEFAULTS, **env}
    for name, value in _env_sets(script):
        if not (start_vars({name: ""}) or name in NOT_AT_START):
            continue
        if value is None or started.get(name) != value:
            return (f"the script sets {name}, which torch or Python read when they start, "
                    f"so its ranks start as new interpreters")
    return None


class Server:
    """The warm process of this launcher. Construct it in a thread that lives as long as the
    launcher: the process is tied to that thread (PR_SET_PDEATHSIG)."""

    def __init__(self, env, ranks=2, join=None):
        self.env = dict(env)
        self.peers = []   # the warm processes of local ranks 1, 2, ... (this one serves rank 0)
        self.dir = tempfile.mkdtemp(prefix="ddp-lesson-warm-")   # mode 0700: this user's only
        self.path = os.path.join(self.dir, "sock")
        self.hello = None
        self.started = threading.Event()   # set once the hello is read (or the process failed)
        me = os.getpid()
        server_env = dict(env)
        server_env[FOR_ENV] = f"{me} {procs.create_time(me)}"
        for k, v in WARM_DEFAULTS.items():
            server_env.setdefault(k, v)
        # an idle OpenBLAS pool is a thread; ranks on a CPU get OMP_NUM_THREADS=1 anyway
        server_env.setdefault("OPENBLAS_NUM_THREADS", "1")
        server_env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"   # asking for GPUs must not initialize CUDA
        with open(os.path.join(self.dir, "server.log"), "wb") as log:
            self.proc = subprocess.Popen(   # in a private network: so are the runs it forks (isolation.py);
                isolation.wrap([sys.executable, "-m", "ddp_lesson.rank.warm.server", "--parent", str(me), self.path,
                                *self._idle_args(join)], join=join),   # a peer joins warm process 0's, where the agent's store is
                env=server_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                start_new_session=True, cwd=os.getcwd())
        threading.Thread(target=self._read_hello, name="ddp-lesson-warm-hello", daemon=True).start()
        self.grow(ranks)

    @staticmethod
    def _idle_args(join):
        idle = idle_seconds()
        return [] if idle <= 0 else ["--idle", str(idle + (PEER_GRACE_S if join else 0))]

    def grow(self, ranks):
        """Have a warm process for each of `ranks` local ranks (from the thread that made this)."""
        while 1 + len(self.peers) < ranks:
            self.peers.append(Server(self.env, ranks=0, join=self.proc.pid))

    def _read_hello(self):
        try:
            line = self.proc.stdout.readline()
            self.hello = json.loads(line) if line else None
        except ValueError:
            self.hello = None
        finally:
            self.proc.stdout.close()
            self.started.set()

    @property
    def pid(self):
        return self.proc.pid

    def ready(self, timeout=None):
        """Wait up to `timeout` seconds for the hellos; True if the processes are up and usable."""
        end = None if timeout is None else time.monotonic() + timeout
        for s in (self, *self.peers):
            s.started.wait(None if end is None else max(0.0, end - time.monotonic()))
        return all(s.hello is not None and s.proc.poll() is None for s in (self, *self.peers))

    def alive(self):
        """Running and reachable: once it said hello its socket must exist (a process that is
        exiting removes its folder first; a launch must not pick it then)."""
        reachable = not self.started.is_set() or os.path.exists(self.path)
        return self.proc.poll() is None and reachable and all(p.alive() for p in self.peers)

    def log_tail(self, chars=2000):
        try:
            with open(os.path.join(self.dir, "server.log"), "rb") as f:
                return f.read()[-chars:].decode(errors="replace").strip()
        except OSError:
            return ""

    def why_not(self, env):
        """None if a launch with `env` can be warm now, else the reason in one sentence."""
        for p in self.peers:
            why = p.why_not(env)
            if why is not None:
                return why
        if not self.started.is_set():
            return "the warm process is still starting"
        if self.hello is None or not self.alive():
            tail = self.log_tail().splitlines()[-1:] or ["no message"]
            return f"the warm process did not start ({tail[0]})"
        if self.hello.get("cuda_initialized") or self.hello.get("forks_poisoned", True):
            return "the warm process asked CUDA's runtime, so its forks could not use a GPU"
        if env.get("CUDA_VISIBLE_DEVICES") and not self.hello.get("nvml_counts"):
            return "torch cannot count GPUs through NVML here, so a warm run's ranks could not use theirs"
        if self.hello.get("fingerprint") != fingerprint():
            return "torch or ddp_lesson changed on disk since the warm process started"
        mine, theirs = start_vars(env), start_vars(self.env)
        for k in sorted(set(mine) | set(theirs)):
            if mine.get(k) != theirs.get(k):
                return f"{k} differs from the warm process's, and it is read only at start-up"
        return None

    def spawn(self, args, env, cwd, log):
        """Ask for an agent running `python -m ddp_lesson.rank.agent ... ARGS` whose
        local rank R is forked by warm process R; returns an Agent once it exists, or raises
        Unavailable."""
        env = {**env, PATHS_ENV: os.pathsep.join(s.path for s in (self, *self.peers))}
        return request(self.path, {"args": list(args), "env": env, "cwd": str(cwd), "log": str(log)})

    def retire(self, wait=2.0):
        """Replaced by a newer one: the runs these processes serve finish, then they exit
        (waits up to `wait` s for that when none runs)."""
        for s in (self, *self.peers):
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                    conn.settimeout(REPLY_TIMEOUT_S)
                    conn.connect(s.path)
                    conn.sendall(b'{"drain": true}\n')
                    conn.recv(100)
            except OSError:
                pass   # not answering: it is gone, or was never up
        end = time.monotonic() + wait
        for s in (self, *self.peers):
            try:
                s.proc.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        threading.Thread(target=self._reap_retired, name="ddp-lesson-warm-retired", daemon=True).start()

    def _reap_retired(self):
        for s in (self, *self.peers):
            s.proc.wait()
            shutil.rmtree(s.dir, ignore_errors=True)

    def stop(self):
        for p in self.peers:
            p.stop()
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)
