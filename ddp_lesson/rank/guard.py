"""What torchrun runs for each rank: `python -m ddp_lesson.rank.guard [--rank] [--parent PID]
[--signal SIG] TARGET ARGS...`. TARGET is a script path or `-m module`. The agent, the process
that runs torchrun, has an entry of its own with the same options: `python -m
ddp_lesson.rank.agent` (agent.py), which uses this file's parent ties.

In every process it wraps, the guard first ties the process to its parent: the kernel
delivers SIG (SIGKILL by default) when the parent dies (prctl PR_SET_PDEATHSIG), and if the
expected parent (--parent, or the agent's PID for a rank) is already gone by the time that
is armed, it exits at once, so a launcher killed right after start() leaves nothing.

- the agent (agent.py, wrapping torchrun; gets SIGTERM so torchrun tears its workers down).
- a rank (`--rank`, or RANK and DDP_LESSON_RUN_DIR set): notes itself in logs/rank<R>.pid;
  sends stdout/stderr to logs/rank<R>.stdout.log / .stderr.log; if the script raises, writes logs/rank<R>.error.json
  and prints the traceback once, from the script's own frames on; dumps its Python stack to
  logs/rank<R>.stack.log on SIGUSR1 (the launcher asks for it when a run times out).
- a forked rank (a warm launch: forked by its own warm process, ddp_lesson.rank.warm.server,
  at the agent's request, see warm.ranks): the same, after it has shed what it inherited
  (warm.fork.shed_inheritance: the warm process's signal handlers and stdio objects; torch's
  and numpy's random state, the temporary folder; OMP_NUM_THREADS as a fresh process takes it).
This file is the rank's side; the agent's is agent.py, the fork machinery's the warm/ package.
A rank imports only the standard library here, so the guard adds nothing measurable to
its start-up.
"""
import atexit
import ctypes
import faulthandler
import gc
import io
import json
import os
import runpy
import select
import signal
import sys
import threading
import time
import traceback
import warnings

from . import rundir

PR_SET_PDEATHSIG = 1
AGENT_ENV = "DDP_LESSON_AGENT_PID"   # a rank's expected parent: the torchrun agent
STACK_SIGNAL = signal.SIGUSR1
FORKED_ENV = "DDP_LESSON_FORKED"     # set by a warm launch: ranks are forked, not started
SCRIPT_ENV = "DDP_LESSON_SCRIPT"     # the learner's own file, which the run directory's script.py copies


def prctl(option, value):
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, int(value), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def watch_parent(sig=signal.SIGKILL, parent=None, interval=0.5, on_orphan=None):
    """Deliver `sig` to this process when `parent` (default: the current parent) goes away;
    exit at once if it is already gone once the kernel has been told.

    Where prctl works the kernel sends the signal, exactly once: a second signal from
    here would interrupt a graceful teardown (torchrun's) half-way. The polling thread
    sends it only where prctl is missing, and then calls `on_orphan` (the agent's
    backstop) in both cases."""
    armed = prctl(PR_SET_PDEATHSIG, sig)
    if parent is None:
        parent = os.getppid()
    if os.getppid() != parent:  # died before prctl was armed: nothing has started yet
        os._exit(128 + int(sig))

    if armed and on_orphan is None:
        return  # the kernel does it all

    def poll():
        while os.getppid() == parent:
            time.sleep(interval)
        if not armed:
            os.kill(os.getpid(), sig)
        if on_orphan is not None:
            on_orphan()

    threading.Thread(target=poll, name="ddp-lesson-parent-guard", daemon=True).start()


def watch_pid(pid, sig=signal.SIGKILL, interval=0.5):
    """Deliver `sig` to this process when process `pid` (not our parent) ends: a warm rank's
    agent, which did not fork it. Exits at once if it is gone already."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is None and not _exists(pid):
        os._exit(128 + int(sig))

    def wait():
        if fd is not None:
            select.select([fd], [], [])
        else:
            while _exists(pid):
                time.sleep(interval)
        os.kill(os.getpid(), sig)

    threading.Thread(target=wait, name="ddp-lesson-agent-guard", daemon=True).start()


def reaped():
    """(pid, exit status as Popen gives it) of each child that has ended, without waiting."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, os.waitstatus_to_exitcode(status)


def _exists(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# -- a rank -----------------------------------------------------------------------------------

def _redirect(run_dir, rank):
    rundir.logs(run_dir).mkdir(parents=True, exist_ok=True)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        f = open(rundir.rank_log(run_dir, rank, name), "ab", buffering=0)
        os.dup2(f.fileno(), fd)
        f.close()
    stack = open(rundir.stack_file(run_dir, rank), "w")
    stack.write(f"main thread {threading.main_thread().ident:#x}\n")
    stack.flush()
    faulthandler.register(STACK_SIGNAL, file=stack, all_threads=True)
    return stack  # kept open for the handler


def _record(run_dir, rank, message, tb):
    data = {"rank": int(rank), "message": message, "traceback": tb, "time": time.time(),
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "pid": os.getpid()}
    if run_dir:
        rundir.write_json(rundir.error_file(run_dir, rank), data)
    # torchrun's own error file, in its format, so its summary shows the traceback too
    err_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if err_file and not os.path.exists(err_file):
        with open(err_file, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {
                "py_callstack": tb, "timestamp": str(int(data["time"]))}}}, f)


def _plumbing(filename):
    return filename in (__file__, "<frozen runpy>") or filename.endswith("runpy.py")


def _user_traceback(e):
    """The traceback as `python script.py` shows it: from the script's own frames on (the
    guard and runpy are noise); a syntax error has none of those frames at all."""
    tb = e.__traceback__
    while tb is not None and _plumbing(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(e), e, tb))


def forked():
    """Is this rank a forked worker of a warm launch (not a fresh interpreter)?"""
    return os.environ.get(FORKED_ENV) == "1"


def run_target(argv, rank=None):
    run_dir = os.environ.get(rundir.ENV)
    if rank is not None and forked():
        from .warm import fork
        fork.shed_inheritance()
    if run_dir and rank is not None:
        _redirect(run_dir, rank)
        rundir.write_pid(run_dir, f"rank{rank}")   # how the launcher finds it (a warm rank is not the agent's child)
    if argv[0] == "-m":
        sys.argv = argv[1:]
        run = lambda: runpy.run_module(argv[1], run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        script = os.path.abspath(argv[0])
        # the learner's own file names the script (__file__, argv[0], argparse's prog), as under
        # torchrun; the code run is the run directory's copy (an edit made during the run is
        # not), and tracebacks and stack dumps name that copy, the code that ran
        own = os.environ.get(SCRIPT_ENV) if rank is not None else None
        name = own if own and os.path.isfile(own) else script
        sys.argv = [name] + argv[1:]
        sys.path[0] = os.path.dirname(name)
        for extra in (os.path.dirname(script), os.environ.get("DDP_LESSON_SCRIPT_DIR")):
            if extra and extra not in sys.path:
                sys.path.insert(1, extra)
        run = lambda: _run_file(script, name)  # noqa: E731
    if rank is None:
        run()
        return
    try:
        run()
    except SystemExit as e:
        if e.code in (None, 0):
            _exit_rank(0)
        code = e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, int):
            print(e.code, file=sys.stderr)  # what the interpreter prints for sys.exit("text")
        _record(run_dir, rank, f"SystemExit: the script exited with status {e.code}", "")
        _exit_rank(code)
    except BaseException as e:
        tb = _user_traceback(e)
        _record(run_dir, rank, f"{type(e).__name__}: {e}", tb)
        sys.stderr.write(tb)  # once, as the interpreter would, without our frames
        _exit_rank(130 if isinstance(e, KeyboardInterrupt) else 1)
    _exit_rank(0)


_main = []   # the script's module: its globals live until the process ends, as in `python script.py`


def _run_file(path, name):
    """Run the file at `path` as __main__ with __file__ `name` (runpy.run_path says `path`)."""
    import types
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    module = types.ModuleType("__main__")
    module.__file__ = name
    module.__cached__ = None
    module.__builtins__ = __builtins__
    sys.modules["__main__"] = module   # and it stays: pickles of the script's classes name it
    _main.append(module)
    exec(code, module.__dict__)


def _wait_for_threads():
    """What the interpreter does before atexit: wait for every non-daemon thread."""
    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and not t.daemon and t is not threading.main_thread():
            t.join()


def _exit_rank(code):
    """A rank exits with `code`. Where torch.distributed was imported it skips the
    interpreter's finalization: there, torch.distributed's C++ threads can be torn down
    in the wrong order and abort the process ("terminate called without an active
    exception", SIGABRT; seen here on gloo, cf. pytorch/pytorch#190489), turning a finished
    run into a failed one and a clean sys.exit(3) into -6. What finalization would do for
    the script is done first: waiting for non-daemon threads, atexit handlers, then
    flushing every open file."""
    if "torch.distributed" not in sys.modules and not forked():
        sys.exit(code)
    # a forked rank leaves alone the file objects it inherited (warm.fork.shed_inheritance noted them)
    inherited = getattr(sys.modules.get("ddp_lesson.rank.warm.fork"), "inherited", lambda obj: False)
    _wait_for_threads()
    atexit._run_exitfuncs()
    with warnings.catch_warnings():  # looking at every object must not print deprecations
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if issubclass(type(obj), io.IOBase) and not inherited(obj):  # type(): no __class__ lookup on proxies
                try:
                    if not obj.closed:
                        obj.flush()
                except Exception:  # a broken pipe or a half-closed stream must not block the exit
                    pass
    os._exit(code)


def options(argv, roles=("--rank",)):
    """(signal, parent, role, the rest) from an entry's command line: --signal TERM, --parent PID
    and one of `roles`, in any order, before the target."""
    sig, parent, role = signal.SIGKILL, None, None
    while argv[:1] and argv[0] in ("--signal", "--parent", *roles):
        if argv[0] == "--signal":
            sig, argv = signal.Signals["SIG" + argv[1]], argv[2:]
        elif argv[0] == "--parent":
            parent, argv = int(argv[1]), argv[2:]
        else:
            role, argv = argv[0][2:], argv[1:]
    return sig, parent, role, argv


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    sig, parent, role, argv = options(argv)
    if not argv:
        sys.exit("usage: python -m ddp_lesson.rank.guard [--rank] [--parent PID] [--signal TERM] "
                 "(SCRIPT | -m MODULE) [ARGS...]")
    if role is None and "RANK" in os.environ and rundir.ENV in os.environ:
        role = "rank"
    if role == "rank" and parent is None and os.environ.get(AGENT_ENV):
        parent = int(os.environ[AGENT_ENV])
    watch_parent(sig, parent)
    agent_pid = os.environ.get(AGENT_ENV)
    if role == "rank" and agent_pid and int(agent_pid) != parent:
        watch_pid(int(agent_pid), sig)   # a warm rank: its warm process forked it, for this agent
    run_target(argv, rank=os.environ.get("RANK", "0") if role == "rank" else None)


if __name__ == "__main__":
    # the package's own module runs, not a second copy named __main__ (agent.py imports it)
    from ddp_lesson.rank import guard
    guard.main()
