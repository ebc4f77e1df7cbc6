"""A warm process of a warm launch: `python -m ddp_lesson.rank.warm.server --parent PID SOCKET [--idle S]`.

It imports torch and what `DDP(...)` imports once, says hello on stdout and waits on a Unix
socket. A launcher holds one per local rank, each a separate interpreter (so each has its own
hash seed). Asked for an agent, one forks a child that becomes the run's torchrun agent: the
module `torch.distributed.run` that a CLI torchrun runs, under the same guard. That agent asks
warm process R for rank R (warm.ranks), which forks a child that runs the guarded rank. Each
answer is the child's PID and, once it has reaped it, its exit status. Asked to drain (a newer
warm process replaces it), it takes no new request and exits once its children have ended.
With `--idle S`, it exits after S seconds with no child and no request (an idle learner then
holds no torch in memory); its launcher starts a new one at the next launch.

It holds one thread whenever it forks (it checks), never initializes CUDA, imports of this
package only the guard and the warm/ room (nothing a learner edits; the agent's fork imports agent.py), and dies with the process that started it.
Standard library and torch only, like the ranks it starts.
"""
import gc
import hashlib
import importlib
import importlib.util
import json
import os
import selectors
import signal
import shutil
import site
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

from .. import guard, rundir
from . import fork

# what a rank of a DDP script imports anyway: torch, and torch._dynamo, which DDP(...) and
# the optimizers import on first use (about half of a rank's start-up on a CPU)
PRELOAD = ("torch", "torch.distributed", "torch.distributed.run", "torch.nn.parallel",
           "torch._dynamo", "torch.optim", "torch.utils.data")
# what it holds of this package, from the package's folder
OWN_FILES = ("__init__.py", "rank/__init__.py", "rank/guard.py", "rank/rundir.py", "rank/warm/__init__.py",
             "rank/warm/fork.py", "rank/warm/server.py")


def fingerprint(here=None):
    """What the warm process was built from: this interpreter, torch's installed files, the
    installed packages' folders and this package's modules it holds (in `here`, this package's folder by default). A launcher
    compares it with the running process's before every launch, so an upgrade or an edit is
    never served by a stale one."""
    here = Path(here or Path(__file__).resolve().parents[2])
    torch_spec = importlib.util.find_spec("torch")   # finds, does not import
    files = [here / name for name in OWN_FILES]
    if torch_spec and torch_spec.origin:
        files.append(Path(torch_spec.origin).parent / "version.py")
    # site-packages folders change when a package is installed, upgraded or removed, or a
    # .pth (an editable install) is added: a warm process holds what was there at its start
    files += [Path(p) for p in site.getsitepackages() + [site.getusersitepackages()]]
    # realpath: a launcher started as ../venv/bin/python has that sys.executable, while the
    # warm process it starts (with it) gets CPython's normalized one (3.11+)
    h = hashlib.sha256(os.path.realpath(sys.executable).encode())
    for f in files:
        try:
            st = f.stat()
            h.update(f"{f}:{st.st_mtime_ns}:{st.st_size}".encode())
        except OSError:
            h.update(f"{f}:missing".encode())
    return h.hexdigest()[:16]


def threads():
    """Threads of this process, as the kernel counts them (native ones included)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _reply(conn, data):
    try:
        conn.sendall((json.dumps(data) + "\n").encode())
    except OSError:
        pass  # the launcher went away: its agent still gets reaped


def _read_request(conn):
    conn.settimeout(10)
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("the launcher closed the connection")
        buf += chunk
    return json.loads(buf)


def _become(req, warm_pid, inherited, fds):
    """In the forked child: drop the warm process's sockets and signal set-up, take the
    launch's session, files, directory and environment, and run the guarded torchrun agent
    (req["role"] "agent") or one rank of a run (role "rank": a warm agent asks for each)."""
    code = 1
    try:
        # the child's own output first, so that whatever fails below shows in its log, not the warm process's
        for fd, path in ((1, req.get("stdout") or req["log"]), (2, req.get("stderr") or req["log"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(f, fd)
            os.close(f)
        fork.fresh_stdio()
        for f in inherited:
            f.close()
        for fd in fds:
            os.close(fd)
        signal.set_wakeup_fd(-1)
        fork.restore_signals()   # SIGCHLD's and any other handler of the warm process
        os.setsid()   # as start_new_session=True: a terminal's Ctrl-C is not the run's
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        if req.get("role") == "rank":
            os.environ[guard.FORKED_ENV] = "1"
        if req.get("role") == "rank":
            guard.main(["--rank", "--parent", str(warm_pid), *req["args"]])
        else:
            # `python -m torch.distributed.run` runs that module once, as __main__: so does this
            sys.modules.pop("torch.distributed.run", None)
            from .. import agent   # only in the agent's fork: a rank never holds it
            agent.main(["--parent", str(warm_pid), *req["args"]])
        code = 0
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT   # what a shell reports for an interpreter killed by Ctrl-C
    except BaseException:
        traceback.print_exc()        # as the interpreter prints an uncaught exception
        code = 1
        _note_early_failure(req)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def serve(listener, idle_s=None):
    """Fork an agent per request; report each agent's PID, then its exit status. Returns when
    drained, or after `idle_s` seconds with no child and no request."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)   # wakes the selector through the pipe
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "child")
    agents = {}   # pid -> the launcher's connection
    draining = False   # replaced by a newer warm process: serve what runs, then exit
    last = time.monotonic()   # the last moment something ran or asked
    while True:
        wait = None if not idle_s or agents or draining else max(0.0, last + idle_s - time.monotonic())
        events = sel.select(wait)
        if not events and wait is not None:
            # idle: nothing is waiting to be accepted now; a launch that connects from here on
            # is refused (the listener closes) and goes cold, or finds the next warm process
            sel.unregister(listener)
            listener.close()
            return
        for key, _ in events:
            if key.data == "child":
                try:
                    while os.read(wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
                _reap(agents)
                continue
            conn, _ = listener.accept()
            try:
                req = _read_request(conn)
            except (OSError, ValueError) as e:
                _reply(conn, {"error": f"bad request: {e}"})
                conn.close()
                continue
            if req.get("drain"):   # no new runs; the running ones finish, then this exits
                draining = True
                sel.unregister(listener)
                listener.close()
                _reply(conn, {"draining": len(agents)})
                conn.close()
                if not agents:
                    return
                continue
            if threads() != 1 or threading.active_count() != 1:
                _reply(conn, {"error": f"the warm process holds {threads()} threads; it forks only with one"})
                conn.close()
                continue
            warm_pid = os.getpid()
            pid = os.fork()
            if pid == 0:
                _become(req, warm_pid, [sel, listener, conn, *agents.values()], (wake_r, wake_w))
            agents[pid] = conn
            _note(pid, req)
            _reply(conn, {"pid": pid})
        _reap(agents)
        if draining and not agents:
            return
        if events or agents:
            last = time.monotonic()


def _note_early_failure(req):
    """A rank that failed before its guard took over its output has printed its traceback to
    torchrun's stream only: put it where the launcher looks for a rank's last words too."""
    env = req.get("env", {})
    if req.get("role") != "rank" or not env.get(rundir.ENV) or not env.get("RANK", "").isdigit():
        return
    try:
        with open(rundir.rank_log(env[rundir.ENV], int(env["RANK"]), "stderr"), "a") as f:
            traceback.print_exc(file=f)
    except OSError:
        pass


_folder = None   # this warm process's folder (its socket's), where it notes each child's run


def _note(pid, req):
    """<folder>/<pid>.run: which run the child `pid` serves. A fork shows this process's
    environment in /proc, not the run's: this note is how procs.warm_children finds it."""
    env = req.get("env", {})
    try:
        rundir.write_json(os.path.join(_folder, f"{pid}.run"), {
            "run_dir": env.get(rundir.ENV), "token": env.get(rundir.TOKEN_ENV),
            "start": rundir.start_ticks(pid)})
    except (OSError, TypeError):
        pass


def _reap(agents):
    for pid, code in guard.reaped():
        try:
            os.unlink(os.path.join(_folder, f"{pid}.run"))
        except (OSError, TypeError):
            pass
        conn = agents.pop(pid, None)
        if conn is not None:
            _reply(conn, {"exit": code})
            conn.close()


def forks_poisoned(torch):
    """Would a fork of this process be unable to use CUDA? torch marks forks bad after any call
    that asked CUDA's runtime, which is_initialized() does not show: one child asks, and exits."""
    pid = os.fork()
    if pid == 0:
        os._exit(int(torch.cuda._is_in_bad_fork()))
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0


def nvml_counts(torch):
    """Can torch count GPUs through NVML here? If not, a warm agent asking for GPUs would ask
    CUDA's runtime and poison its forks (kernel.warm sets PYTORCH_NVML_BASED_CUDA_CHECK)."""
    try:
        return torch.cuda._raw_device_count_nvml() >= 0
    except OSError:   # no NVML library: no driver
        return False


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    idle_s = None
    if len(argv) == 5 and argv[3] == "--idle":
        idle_s = float(argv.pop(4))
        argv.pop(3)
    if len(argv) != 3 or argv[0] != "--parent":
        sys.exit("usage: python -m ddp_lesson.rank.warm.server --parent PID SOCKET [--idle S]")
    parent, path = int(argv[1]), argv[2]
    fork.remember_signals()
    global _folder
    folder = _folder = os.path.dirname(path)

    def gone(*_):   # the launcher died (a killed kernel, a stopped server), or this one is done: no folder left behind
        shutil.rmtree(folder, ignore_errors=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, gone)   # forks put it back (fork.restore_signals)
    guard.watch_parent(signal.SIGTERM, parent)   # the launcher gone: so is this
    hello = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)   # nothing else of ours goes to the launcher's pipe
    os.close(devnull)
    fork.import_torch_counting_threads(PRELOAD)
    # what is here now is shared by every fork: the collector leaves it alone (no copy-on-write
    # of its pages) and gc.get_objects() in a fork lists only what came after (guard's scans)
    gc.freeze()
    torch = sys.modules["torch"]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    hello.write(json.dumps({
        "pid": os.getpid(), "fingerprint": fingerprint(), "torch": torch.__version__,
        "cuda_initialized": bool(torch.cuda.is_initialized()), "forks_poisoned": forks_poisoned(torch),
        "nvml_counts": nvml_counts(torch), "threads": threads(),
        "modules": sorted(m for m in sys.modules if m == "ddp_lesson" or m.startswith("ddp_lesson.")),
    }) + "\n")
    hello.close()
    serve(listener, idle_s)
    gone()   # idle, or drained: every run it served has ended (a drained one's launcher removes the folder too)


if __name__ == "__main__":
    main()
