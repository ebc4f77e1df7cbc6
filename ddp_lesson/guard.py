"""What torchrun actually runs: `python -m ddp_lesson.guard [--signal SIG] TARGET ARGS...`.

TARGET is a script path or `-m module`. Before running it, the guard
- ends this process when its parent dies (a killed kernel or agent leaves nothing behind),
- in a rank (RANK set and DDP_LESSON_RUN_DIR set): sends the rank's stdout/stderr to
  logs/rank<R>.stdout.log / .stderr.log and, if the script raises, writes
  logs/rank<R>.error.json with the traceback, also for scripts without @record.
Imports only the standard library, so it adds nothing measurable to start-up.
"""
import atexit
import ctypes
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

PR_SET_PDEATHSIG = 1


def watch_parent(sig=signal.SIGKILL, interval=0.5):
    """Deliver `sig` to this process when its parent goes away."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:  # the kernel delivers the signal at once; the thread below is the fallback
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))
        except (OSError, AttributeError):
            pass

    def poll():
        while True:
            if os.getppid() != parent:
                os.kill(os.getpid(), sig)
                time.sleep(3)  # a graceful signal had its chance; finish the job
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(interval)

    threading.Thread(target=poll, name="ddp-lesson-parent-guard", daemon=True).start()


def _redirect(run_dir, rank):
    logs = os.path.join(run_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        f = open(os.path.join(logs, f"rank{rank}.{name}.log"), "ab", buffering=0)
        os.dup2(f.fileno(), fd)
        f.close()


def _record(run_dir, rank, message, tb):
    data = {"rank": int(rank), "message": message, "traceback": tb, "time": time.time(),
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "pid": os.getpid()}
    if run_dir:
        path = os.path.join(run_dir, "logs", f"rank{rank}.error.json")
        with open(path + ".tmp", "w") as f:
            json.dump(data, f)
        os.replace(path + ".tmp", path)
    # torchrun's own error file, in its format, so its summary shows the traceback too
    err_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if err_file and not os.path.exists(err_file):
        with open(err_file, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {
                "py_callstack": tb, "timestamp": str(int(data["time"]))}}}, f)


def _user_traceback(e):
    """The traceback from the script's own frames on (the guard and runpy are noise)."""
    tb = e.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>")
                              or tb.tb_frame.f_code.co_filename.endswith("runpy.py")):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(e), e, tb or e.__traceback__))


def run_target(argv):
    run_dir = os.environ.get("DDP_LESSON_RUN_DIR")
    rank = os.environ.get("RANK")
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
    try:
        run()
    except SystemExit as e:
        if e.code not in (None, 0):
            if rank is not None:
                _record(run_dir, rank, f"SystemExit: the script exited with status {e.code}", "")
            raise
    except BaseException as e:
        if rank is not None:
            _record(run_dir, rank, f"{type(e).__name__}: {e}", _user_traceback(e))
        raise
    if rank is not None and "torch.distributed" in sys.modules:
        _exit_without_finalizing()


def _exit_without_finalizing():
    """A rank that finished its work exits 0 without the interpreter's finalization: there,
    torch.distributed's C++ threads can be torn down in the wrong order and abort the
    process ("terminate called without an active exception", SIGABRT; seen here on gloo,
    cf. pytorch/pytorch#190489), turning a finished run into a failed one. What
    finalization would do for the script is done first: atexit handlers, then flushing
    every open file."""
    atexit._run_exitfuncs()
    for obj in gc.get_objects():
        if isinstance(obj, io.IOBase):
            try:
                if not obj.closed:
                    obj.flush()
            except Exception:  # a broken pipe or a half-closed stream must not block the exit
                pass
    os._exit(0)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    sig = signal.SIGKILL
    if argv[:1] == ["--signal"]:
        sig = signal.Signals["SIG" + argv[1]]
        argv = argv[2:]
    if not argv:
        sys.exit("usage: python -m ddp_lesson.guard [--signal TERM] (SCRIPT | -m MODULE) [ARGS...]")
    watch_parent(sig)
    run_target(argv)


if __name__ == "__main__":
    main()
