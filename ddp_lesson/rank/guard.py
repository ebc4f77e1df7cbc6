"""What the launcher runs: `python -m ddp_lesson.rank.guard [--agent|--rank] [--parent PID]
[--signal SIG] TARGET ARGS...`. TARGET is a script path or `-m module`.

In every process it wraps, the guard first ties the process to its parent: the kernel
delivers SIG (SIGKILL by default) when the parent dies (prctl PR_SET_PDEATHSIG), and if the
expected parent (--parent, or the agent's PID for a rank) is already gone by the time that
is armed, it exits at once, so a launcher killed right after start() leaves nothing.

- the agent (`--agent`, wrapping torchrun; gets SIGTERM so torchrun tears its workers down):
  becomes a child subreaper, so whatever a rank spawns (a daemon, a new session) stays
  below it; when torchrun returns, fails or is stopped it ends every descendant and every
  process that carries this run's identity (DDP_LESSON_RUN_DIR and DDP_LESSON_RUN_TOKEN);
  writes logs/agent.failures.json from torchrun's own failure record (rank, exit code,
  error file, timestamp) or the signal that stopped it.
- a rank (`--rank`, or RANK and DDP_LESSON_RUN_DIR set): sends stdout/stderr to
  logs/rank<R>.stdout.log / .stderr.log; if the script raises, writes logs/rank<R>.error.json
  and prints the traceback once, from the script's own frames on; dumps its Python stack to
  logs/rank<R>.stack.log on SIGUSR1 (the launcher asks for it when a run times out).
- a forked rank (a warm launch: torchrun's own `--run-path --start-method fork`, from an
  agent forked by ddp_lesson.rank.warm_server): the same, after it has shed what it inherited
  (the warm process's signal handlers, atexit handlers and stdio objects, whose locks another
  thread may have held at the fork; torch's and numpy's random state) and taken
  OMP_NUM_THREADS as a fresh process would; a clean exit returns to torch's worker code, which hands torchrun the result.
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
import signal
import sys
import threading
import time
import traceback
import warnings
import weakref

from . import rundir

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
AGENT_ENV = "DDP_LESSON_AGENT_PID"   # a rank's expected parent: the torchrun agent
AGENT_TEARDOWN_S = 15                # after its parent died, torchrun's teardown gets this long
STACK_SIGNAL = signal.SIGUSR1
FORKED_ENV = "DDP_LESSON_FORKED"     # set by a warm launch: ranks are forked, not started
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
_launch_nvml_check = None             # a warm agent's: the launch's own value, for its ranks


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
        if forked() and rows:
            rows += _other_forked_failures(rows)
        _write_failures({"failures": rows, "time": time.time()})
    elif type(e).__name__ == "SignalException":
        _write_failures({"signal": getattr(e, "sigval", signal.SIGTERM).name, "time": time.time()})


def _other_forked_failures(rows):
    """With forked workers torch reports one failure, the first its poll finds, not the first
    that happened: a rank killed by SIGKILL can lose to the peer that raised "connection closed"
    because of it. A subprocess agent reports every failed worker; here the others come from
    multiprocessing's records of this agent's workers. An attempt's workers are created in
    local-rank order, so their creation numbers (in their names, "ForkProcess-N") give the rank."""
    import multiprocessing.process
    workers = {}
    for proc in gc.get_objects():
        if issubclass(type(proc), multiprocessing.process.BaseProcess) and proc.pid != os.getpid():
            number = proc.name.rsplit("-", 1)[-1].split(":")[-1]
            if number.isdigit():
                workers[int(number)] = proc
    first = rows[0]
    known = next((n for n, proc in workers.items() if proc.pid == first["pid"]), None)
    if known is None:
        return []
    extra, reported = [], {r["local_rank"] for r in rows}
    for number, proc in workers.items():
        local = first["local_rank"] + number - known
        if local < 0 or local in reported or proc.exitcode in (None, 0):
            continue
        extra.append({"rank": first["rank"] - first["local_rank"] + local, "local_rank": local,
                      "pid": proc.pid, "exitcode": proc.exitcode, "error_file": None,
                      "timestamp": first["timestamp"], "message": ""})
    return extra


def run_agent(argv):
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    os.environ[AGENT_ENV] = str(os.getpid())
    launcher = os.getppid()
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


def environ_space():
    """(address, size) of the text /proc/<pid>/environ shows: the environment this process's
    program was started with, which a later change to os.environ does not alter."""
    with open("/proc/self/stat") as f:
        data = f.read()
    fields = data[data.rindex(")") + 2:].split()   # fields[0] is field 3 of proc(5)
    start, end = int(fields[50 - 3]), int(fields[51 - 3])
    return start, end - start


FIRST_IN_ENVIRON = (rundir.ENV, rundir.TOKEN_ENV, "RANK", "LOCAL_RANK", "WORLD_SIZE")


def environ_text(env):
    """The environment as /proc/<pid>/environ holds it, the run's identity first."""
    keys = [k for k in FIRST_IN_ENVIRON if k in env] + [k for k in env if k not in FIRST_IN_ENVIRON]
    return b"".join(f"{k}={env[k]}".encode(errors="surrogateescape") + b"\0" for k in keys)


def publish_environ():
    """Make /proc/<pid>/environ show os.environ as it is now. It is how this course knows a
    run's processes (procs.run_processes, cleanup, the agent's sweep), and a forked process
    would otherwise show the environment of the process it was forked from. The text is
    written over the original (the warm process starts with padding for it); what does not
    fit is left out, whole variables from the end, so the run's identity always fits. libc's
    own environment no longer points there once os.environ was cleared. True if all fit."""
    start, size = environ_space()
    text = environ_text(os.environ)
    fits = len(text) <= size
    if not fits:
        text = text[:text.rindex(b"\0", 0, size) + 1]
    ctypes.memmove(start, text + b"\0" * (size - len(text)), size)
    return fits


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


def count_gpus_without_cuda():
    """In a warm launch's agent, before torchrun runs: its LaunchConfig asks
    torch.accelerator.is_available(), which asks CUDA's runtime and poisons fork unless
    NVML_CHECK is "1" and NVML can count (warm.py goes cold for GPUs where it cannot); the
    ranks are forks of this agent. A poisoned rank could not use its GPU ("Cannot
    re-initialize CUDA in forked subprocess"). Each forked rank takes the launch's value back."""
    global _launch_nvml_check
    _launch_nvml_check = os.environ.get(NVML_CHECK)
    os.environ[NVML_CHECK] = "1"


def forked():
    """Is this rank a forked worker of a warm launch (not a fresh interpreter)?"""
    return os.environ.get(FORKED_ENV) == "1"


def _shed_inheritance():
    """What a forked rank must not keep from the process it was forked from."""
    restore_signals()
    atexit._clear()  # the warm process's handlers are not the script's
    if _launch_nvml_check is None:   # the launch's environment, as a cold rank gets it
        os.environ.pop(NVML_CHECK, None)
    else:
        os.environ[NVML_CHECK] = _launch_nvml_check
    # inherited file objects are not flushed at the end: their buffers hold the agent's
    # output (it would come out twice) and their locks may be held by a thread not here
    _inherited_files.update(o for o in gc.get_objects() if issubclass(type(o), io.IOBase))
    publish_environ()  # RANK and the rest, which torch's worker code has just set
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


def run_target(argv, rank=None):
    run_dir = os.environ.get(rundir.ENV)
    if rank is not None and forked():
        _shed_inheritance()
    if run_dir and rank is not None:
        _redirect(run_dir, rank)
    if argv[0] == "-m":
        sys.argv = argv[1:]
        run = lambda: runpy.run_module(argv[1], run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        script = os.path.abspath(argv[0])
        sys.argv = [script] + argv[1:]
        sys.path[0] = os.path.dirname(script)
        extra = os.environ.get("DDP_LESSON_SCRIPT_DIR")  # where the original script lives
        if extra and extra not in sys.path:
            sys.path.insert(1, extra)
        run = lambda: runpy.run_path(script, run_name="__main__")  # noqa: E731
    if rank is None:
        run()
        return
    real_exit, keep = os._exit, forked()
    if keep:
        os._exit = _zero_exit_returns(real_exit)
    try:
        # a forked rank ends in torch's worker code, not in os._exit here: it keeps the
        # script's globals and frames, so no destructor runs then (one can abort the process)
        result = run()
        if keep:
            _kept.append(result)
    except SystemExit as e:
        if keep:
            _kept.append(e)
        if e.code in (None, 0):
            os._exit = real_exit
            _exit_rank(0)
            return
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
    os._exit = real_exit
    _exit_rank(0)


_kept = []


def _zero_exit_returns(real_exit):
    """os._exit for a forked rank's script: torchrun collects a forked rank's result when it
    returns, so os._exit(0) (some scripts leave that way, to skip destructors) ends the
    script as sys.exit(0) does. Its own children (a DataLoader's workers) exit for real."""
    rank_pid = os.getpid()

    def _exit(code):
        if code == 0 and os.getpid() == rank_pid:
            raise SystemExit(0)
        real_exit(code)
    return _exit


def _exit_rank(code):
    """A rank exits with `code`. Where torch.distributed was imported it skips the
    interpreter's finalization: there, torch.distributed's C++ threads can be torn down
    in the wrong order and abort the process ("terminate called without an active
    exception", SIGABRT; seen here on gloo, cf. pytorch/pytorch#190489), turning a finished
    run into a failed one and a clean sys.exit(3) into -6. What finalization would do for
    the script is done first: atexit handlers, then flushing every open file.
    A forked rank that succeeded returns instead: torch's worker code then hands torchrun
    its result and exits without finalization (multiprocessing's os._exit)."""
    if "torch.distributed" not in sys.modules and not forked():
        sys.exit(code)
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
    if code == 0 and forked():
        return
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
    if role == "agent":
        run_agent(argv)
    else:
        run_target(argv, rank=os.environ.get("RANK", "0") if role == "rank" else None)


if __name__ == "__main__":
    main()
