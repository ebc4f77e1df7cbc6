"""What the launcher runs: `python -m ddp_lesson.rank.guard [--agent|--rank] [--parent PID]
[--signal SIG] TARGET ARGS...`. TARGET is a script path or `-m module`.

In every process it wraps, the guard first ties the process to its parent: the kernel
delivers SIG (SIGKILL by default) when the parent dies (prctl PR_SET_PDEATHSIG), and if the
expected parent (--parent, or the agent's PID for a rank) is already gone by the time that
is armed, it exits at once, so a launcher killed right after start() leaves nothing.

- the agent (`--agent`, wrapping torchrun; gets SIGTERM so torchrun tears its workers down):
  becomes a child subreaper, so whatever a rank spawns (a daemon, a new session) stays
  below it; notes itself in logs/agent.pid; when torchrun returns, fails or is stopped it
  ends every descendant and every process of this run (procs.run_processes);
  writes logs/agent.failures.json from torchrun's own failure record (rank, exit code,
  error file, timestamp) or the signal that stopped it.
- a rank (`--rank`, or RANK and DDP_LESSON_RUN_DIR set): notes itself in logs/rank<R>.pid; sends stdout/stderr to
  logs/rank<R>.stdout.log / .stderr.log; if the script raises, writes logs/rank<R>.error.json
  and prints the traceback once, from the script's own frames on; dumps its Python stack to
  logs/rank<R>.stack.log on SIGUSR1 (the launcher asks for it when a run times out).
- a forked rank (a warm launch: forked by its own warm process, ddp_lesson.rank.warm_server,
  at the agent's request, see warm_ranks): the same, after it has shed what it inherited (the
  warm process's signal handlers and stdio objects; torch's and numpy's random state, the
  temporary folder) and taken OMP_NUM_THREADS as a fresh process would.
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
import weakref

from . import rundir

WARM_RANKS_ENV = "DDP_LESSON_WARM_RANKS"   # warm_ranks.PATHS_ENV (not imported: cold ranks need nothing of it)
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
AGENT_ENV = "DDP_LESSON_AGENT_PID"   # a rank's expected parent: the torchrun agent
AGENT_TEARDOWN_S = 15                # after its parent died, torchrun's teardown gets this long
STACK_SIGNAL = signal.SIGUSR1
FORKED_ENV = "DDP_LESSON_FORKED"     # set by a warm launch: ranks are forked, not started
SCRIPT_ENV = "DDP_LESSON_SCRIPT"     # the learner's own file, which the run directory's script.py copies


def _prctl(option, value):
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
    armed = _prctl(PR_SET_PDEATHSIG, sig)
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


def _exists(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# -- the agent --------------------------------------------------------------------------------

def _run_identity():
    return os.environ.get(rundir.ENV), os.environ.get(rundir.TOKEN_ENV)


def sweep():
    """End every descendant of this process and every process of this run (same run
    directory and token), then reap what became our children. Called by the agent last."""
    try:
        import psutil
        from ddp_lesson.rank import procs
    except ImportError:
        return
    try:
        found = psutil.Process().children(recursive=True)
    except psutil.Error:
        found = []
    run_dir, token = _run_identity()
    if run_dir and token:
        found += procs.run_processes(run_dir, token=token)
    procs.kill_all(found)
    procs.wait_gone(found, timeout=5)
    for _ in reaped():   # a subreaper inherits orphans: collect their exit statuses
        pass


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


def _write_failures(data):
    run_dir, _ = _run_identity()
    if not run_dir:
        return
    try:
        rundir.write_json(rundir.agent_failures(run_dir), data)
    except OSError:
        pass


def _record_agent_exit(e):
    """torchrun's own structured record of the final attempt, not its printed summary."""
    if type(e).__name__ == "ChildFailedError":
        rows = [{"rank": int(rank), "local_rank": f.local_rank, "pid": f.pid, "exitcode": f.exitcode,
                 "error_file": f.error_file, "timestamp": f.timestamp, "message": f.message}
                for rank, f in sorted(e.failures.items())]
        _write_failures({"failures": rows, "time": time.time()})
    elif type(e).__name__ == "SignalException":
        _write_failures({"signal": getattr(e, "sigval", signal.SIGTERM).name, "time": time.time()})


def run_agent(argv):
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    os.environ[AGENT_ENV] = str(os.getpid())
    launcher = os.getppid()
    if _run_identity()[0]:
        rundir.write_pid(_run_identity()[0], "agent")
    paths = os.environ.pop(WARM_RANKS_ENV, "")
    if paths:   # a warm launch: each rank is forked by its own warm process
        from . import warm_ranks
        warm_ranks.install(paths.split(os.pathsep))
    try:
        run_target(argv, rank=None)
    except BaseException as e:
        _record_agent_exit(e)
        raise
    finally:
        sweep()
        if os.getppid() != launcher:   # nobody is left to say how the run ended: say it here
            rundir.record_orphaned(_run_identity()[0])


def _orphaned_agent():
    """The launcher died; torchrun got SIGTERM and tears down. If that takes too long,
    end the subtree and exit anyway."""
    time.sleep(AGENT_TEARDOWN_S)
    sweep()
    rundir.record_orphaned(_run_identity()[0])
    os._exit(1)


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


_start_signals = {}
_inherited_files = weakref.WeakSet()


def remember_signals():
    """Note the signal dispositions this process started with. A process that forks runs
    (the warm process) calls it first, so each fork can be put back as a new interpreter
    would be: torchrun's agent handles SIGTERM by raising an exception, and a rank forked
    from it would otherwise raise it in the learner's code instead of ending."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if handler is not None:
            _start_signals[sig] = handler


def restore_signals():
    for sig, handler in _start_signals.items():
        try:
            signal.signal(sig, handler)
        except (OSError, ValueError):
            pass


def fresh_stdio():
    """New sys.stdout and sys.stderr on file descriptors 1 and 2, unbuffered like `python -u`:
    for a forked process, whose inherited objects belong to the process it was copied from."""
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True,
                                  write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True,
                                  write_through=True, errors="backslashreplace")


def forked():
    """Is this rank a forked worker of a warm launch (not a fresh interpreter)?"""
    return os.environ.get(FORKED_ENV) == "1"


def _shed_inheritance():
    """What a forked rank must not keep from the warm process it was forked from. That
    process only imported torch and waited, so its atexit handlers are what `import torch`
    registers in a new interpreter too: they stay."""
    restore_signals()
    # inherited file objects are not flushed at the end: their buffers hold the agent's
    # output (it would come out twice) and their locks may be held by a thread not here
    _inherited_files.update(o for o in gc.get_objects() if issubclass(type(o), io.IOBase))
    # a process forked from here shows the warm process's environment in /proc, not the run's:
    # each one notes itself in the run's logs/, where procs looks (an exec'd one carries the run's)
    run_dir = os.environ.get(rundir.ENV)
    if run_dir:
        os.register_at_fork(after_in_child=lambda: rundir.write_pid(run_dir, f"fork{os.getpid()}"))
    # another thread of the agent may have held a stdio object's lock at the fork; that
    # thread does not exist here, so the lock would never be released: take new objects
    fresh_stdio()
    # seeded once in the warm process, every rank would draw alike; a new process seeds
    # from the OS (Python's random reseeds itself after a fork)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()   # CUDA's generators too, lazily: it does not initialize CUDA
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # what import torch does with it in a new process
    import tempfile
    tempfile.tempdir = None   # found again from this launch's TMPDIR, as a new process would


def run_target(argv, rank=None):
    run_dir = os.environ.get(rundir.ENV)
    if rank is not None and forked():
        _shed_inheritance()
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
    _wait_for_threads()
    atexit._run_exitfuncs()
    with warnings.catch_warnings():  # looking at every object must not print deprecations
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if issubclass(type(obj), io.IOBase) and obj not in _inherited_files:  # type(): no __class__ lookup on proxies
                try:
                    if not obj.closed:
                        obj.flush()
                except Exception:  # a broken pipe or a half-closed stream must not block the exit
                    pass
    os._exit(code)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    sig, parent, role = signal.SIGKILL, None, None
    while argv[:1] and argv[0] in ("--signal", "--parent", "--agent", "--rank"):
        if argv[0] == "--signal":
            sig, argv = signal.Signals["SIG" + argv[1]], argv[2:]
        elif argv[0] == "--parent":
            parent, argv = int(argv[1]), argv[2:]
        else:
            role, argv = argv[0][2:], argv[1:]
    if not argv:
        sys.exit("usage: python -m ddp_lesson.rank.guard [--agent|--rank] [--parent PID] [--signal TERM] "
                 "(SCRIPT | -m MODULE) [ARGS...]")
    if role is None and "RANK" in os.environ and rundir.ENV in os.environ:
        role = "rank"
    if role == "rank" and parent is None and os.environ.get(AGENT_ENV):
        parent = int(os.environ[AGENT_ENV])
    watch_parent(sig, parent, on_orphan=_orphaned_agent if role == "agent" else None)
    agent = os.environ.get(AGENT_ENV)
    if role == "rank" and agent and int(agent) != parent:
        watch_pid(int(agent), sig)   # a warm rank: its warm process forked it, for this agent
    if role == "agent":
        run_agent(argv)
    else:
        run_target(argv, rank=os.environ.get("RANK", "0") if role == "rank" else None)


if __name__ == "__main__":
    main()
