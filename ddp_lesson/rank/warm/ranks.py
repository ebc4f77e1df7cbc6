"""A warm agent's ranks: each one forked by its own warm process, not by the agent.

torchrun starts each rank as a subprocess (`python -u -m ddp_lesson.rank.guard --rank ...`),
as a CLI torchrun does. In a warm launch the agent asks warm process R (one per local rank,
each a separate interpreter that has imported torch) to fork rank R instead, and hands
torchrun a Popen-like handle of it. So a rank is a fresh interpreter's plain fork: its own
hash seed (one per warm process), the main process of its multiprocessing, a real os._exit,
and no torchrun worker code in it. A rank no warm process can serve starts as a subprocess.

    install(paths)   # in the agent, before torchrun starts: paths[R] is warm process R's socket
"""
import json
import os
import select
import socket
import subprocess
import sys
import time

PATHS_ENV = "DDP_LESSON_WARM_RANKS"   # the warm processes' sockets, one per local rank, os.pathsep-joined
REPLY_TIMEOUT_S = 10
RANK_ENTRY = ("-u", "-m", "ddp_lesson.rank.guard", "--rank")   # what torchrun runs for each rank


class Unavailable(Exception):
    """No warm process can serve this request (the sentence says why)."""


class Lost(Exception):
    """The warm process died while its child ran, so the child's exit status is lost."""


class Child:
    """A process forked by a warm process, watched through its socket; like a Popen: pid,
    returncode, wait(timeout), poll(), send_signal()."""

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
            raise subprocess.TimeoutExpired(f"process {self.pid}", timeout) from None
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

    def send_signal(self, sig):
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(15)

    def kill(self):
        self.send_signal(9)


def request(path, req):
    """Send one request to the warm process at `path`; returns a Child once it exists."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(REPLY_TIMEOUT_S)
        s.connect(path)
        s.sendall((json.dumps(req) + "\n").encode())
        child = Child(s)
        reply = child.next_message(REPLY_TIMEOUT_S)
    except (OSError, ValueError, TimeoutError) as e:
        s.close()
        raise Unavailable(f"the warm process did not answer ({e})") from None
    if reply is None or "pid" not in reply:
        s.close()
        raise Unavailable((reply or {}).get("error", "the warm process closed the connection"))
    child.pid = reply["pid"]
    return child


def _own_output(fd):
    """Where this agent's file descriptor `fd` writes, for a rank another process forks: the
    file's own path where it is a file. Another process opening /proc/<agent>/fd/<fd> needs
    ptrace-read access to the agent, which the kernel refused now and then (EACCES, seen as a
    rank 1 that exited with status 1 before its guard started: a peer warm process that had
    joined warm process 0's namespace before its ids were mapped held no capabilities, the
    agent all; netns.join now waits for the maps)."""
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        path = ""
    return path if path.startswith("/") and os.path.isfile(path) else f"/proc/{os.getpid()}/fd/{fd}"


def install(paths):
    """Make this agent's torchrun ask warm process R for local rank R."""
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    class WarmRankHandler(SubprocessHandler):
        def _popen(self, args, env):
            rest = list(args[1:])
            if args[0] == sys.executable and tuple(rest[:len(RANK_ENTRY)]) == RANK_ENTRY \
                    and self.local_rank_id < len(paths):
                req = {"role": "rank", "args": rest[len(RANK_ENTRY):], "env": dict(env), "cwd": os.getcwd(),
                       "log": _own_output(1),   # the agent's own output, as a subprocess inherits it
                       "stdout": self._stdout.name if self._stdout else _own_output(1),
                       "stderr": self._stderr.name if self._stderr else _own_output(2)}
                try:
                    return request(paths[self.local_rank_id], req)
                except Unavailable as e:
                    print(f"[ddp_lesson] local rank {self.local_rank_id} starts cold: {e}", file=sys.stderr)
            return super()._popen(args, env)

    def get_subprocess_handler(entrypoint, args, env, stdout, stderr, local_rank_id, numa_options=None):
        return WarmRankHandler(entrypoint=entrypoint, args=args, env=env, stdout=stdout, stderr=stderr,
                               local_rank_id=local_rank_id, numa_options=numa_options)

    api.get_subprocess_handler = get_subprocess_handler
