"""The launcher's side of warm launches: one warm process per launcher (ddp_lesson.rank.warm_server),
started ahead of need, checked before every launch, asked for each run's torchrun agent.

    server = warm.Server(env)        # from a long-lived thread: the process dies with that thread's process
    server.ready(timeout)            # True once it has imported torch and said hello
    server.why_not(env)              # None, or the sentence saying why this launch must be cold
    agent = server.spawn(args, env, cwd, log)   # agent.pid, agent.wait(timeout), agent.poll()

A launch goes cold (a new interpreter for the agent and every rank, as a CLI torchrun) when
the warm process is not up, is stale, or the launch's environment differs in a variable
that torch or Python read at start-up, which a forked process cannot read again.
"""
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

from . import isolation
from ..rank import procs
from ..rank.procs import FOR_ENV
from ..rank.warm_server import PAD_BYTES, PAD_ENV, fingerprint

# read when Python or torch start (TORCH_DISTRIBUTED_DEBUG when torch.distributed is imported,
# TORCH_LOGS when torch is): a process forked from one started with other values would not be
# what the launch asked for. Any TORCH*/PYTORCH_ variable counts, but for the few read later,
# when a process group or a rendezvous is made. OMP_NUM_THREADS is applied again in each rank.
START_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONSAFEPATH", "PYTHONNOUSERSITE",
             "PYTHONWARNINGS", "PYTHONDONTWRITEBYTECODE", "LD_PRELOAD", "LD_LIBRARY_PATH",
             "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "LOGLEVEL")   # LOGLEVEL: torch.distributed.elastic's logger
START_PREFIXES = ("TORCH", "PYTORCH_", "KMP_", "GOMP_")
READ_LATER = ("TORCH_NCCL_", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
REPLY_TIMEOUT_S = 10


class Unavailable(Exception):
    """No warm agent for this launch (the sentence says why); the launcher goes cold."""


class Lost(Exception):
    """The warm process died while one of its agents ran, so the agent's exit status is lost."""


def start_vars(env):
    return {k: v for k, v in env.items()
            if (k in START_ENV or k.startswith(START_PREFIXES)) and not k.startswith(READ_LATER)}


class Server:
    """The warm process of this launcher. Construct it in a thread that lives as long as the
    launcher: the process is tied to that thread (PR_SET_PDEATHSIG)."""

    def __init__(self, env):
        self.env = dict(env)
        self.dir = tempfile.mkdtemp(prefix="ddp-lesson-warm-")   # mode 0700: this user's only
        self.path = os.path.join(self.dir, "sock")
        self.hello = None
        self.started = threading.Event()   # set once the hello is read (or the process failed)
        me = os.getpid()
        server_env = dict(env)
        server_env[FOR_ENV] = f"{me} {procs.create_time(me)}"
        server_env[PAD_ENV] = "x" * PAD_BYTES
        # an idle OpenBLAS pool is a thread; ranks on a CPU get OMP_NUM_THREADS=1 anyway
        server_env.setdefault("OPENBLAS_NUM_THREADS", "1")
        server_env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"   # asking for GPUs must not initialize CUDA
        with open(os.path.join(self.dir, "server.log"), "wb") as log:
            self.proc = subprocess.Popen(   # in a private network: so are the runs it forks (isolation.py)
                isolation.wrap([sys.executable, "-m", "ddp_lesson.rank.warm_server", "--parent", str(me), self.path]),
                env=server_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                start_new_session=True, cwd=os.getcwd())
        threading.Thread(target=self._read_hello, name="ddp-lesson-warm-hello", daemon=True).start()

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
        """Wait up to `timeout` seconds for the hello; True if the process is up and usable."""
        self.started.wait(timeout)
        return self.hello is not None and self.proc.poll() is None

    def alive(self):
        return self.proc.poll() is None

    def log_tail(self, chars=2000):
        try:
            with open(os.path.join(self.dir, "server.log"), "rb") as f:
                return f.read()[-chars:].decode(errors="replace").strip()
        except OSError:
            return ""

    def why_not(self, env):
        """None if a launch with `env` can be warm now, else the reason in one sentence."""
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
        """Ask for an agent running `python -m ddp_lesson.rank.guard --agent ... ARGS`; returns an
        Agent once it exists, or raises Unavailable."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(REPLY_TIMEOUT_S)
            s.connect(self.path)
            s.sendall((json.dumps({"args": list(args), "env": dict(env), "cwd": str(cwd),
                                   "log": str(log)}) + "\n").encode())
            agent = Agent(s)
            reply = agent.next_message(REPLY_TIMEOUT_S)
        except (OSError, ValueError) as e:
            s.close()
            raise Unavailable(f"the warm process did not answer ({e})") from None
        if reply is None or "pid" not in reply:
            s.close()
            raise Unavailable((reply or {}).get("error", "the warm process closed the connection"))
        agent.pid = reply["pid"]
        return agent

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)


class Agent:
    """A run's agent, forked by the warm process; like a Popen: pid, wait(timeout), poll()."""

    def __init__(self, sock):
        self.pid = None
        self.returncode = None
        self._sock = sock
        self._buf = b""
        self._lost = False

    def next_message(self, timeout):
        """The next message from the warm process, None at end of stream, or TimeoutError."""
        end = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if end is None else max(0.0, end - time.monotonic())
            if not select.select([self._sock], [], [], left)[0]:
                raise TimeoutError("no message from the warm process")
            chunk = self._sock.recv(65536)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def wait(self, timeout=None):
        if self.returncode is not None:
            return self.returncode
        if self._lost:
            raise Lost("the warm process that started this run died during it")
        try:
            msg = self.next_message(timeout)
        except TimeoutError:
            raise subprocess.TimeoutExpired(f"agent {self.pid}", timeout) from None
        if msg is None or "exit" not in msg:
            self._lost = True
            self._sock.close()
            raise Lost("the warm process that started this run died during it")
        self.returncode = msg["exit"]
        self._sock.close()
        return self.returncode

    def poll(self):
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None
