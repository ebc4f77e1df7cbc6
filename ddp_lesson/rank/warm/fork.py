"""What a forked process must shed or reset so that it is what a new interpreter would be: the
fork-only part of the guard (warm ranks and agents, forked by warm.server).

    remember_signals()   # in the warm process, before anything changes a disposition
    restore_signals()    # in a fork: the dispositions a new interpreter starts with
    fresh_stdio()        # in a fork: sys.stdout/stderr of its own (an inherited lock may be held)
    shed_inheritance()   # in a forked rank, first (guard.run_target calls it when guard.forked())
    inherited(obj)       # a file object it inherited: not flushed at its exit (guard._exit_rank)
"""
import gc
import io
import os
import signal
import sys
import weakref

from .. import rundir


_start_signals = {}
_inherited_files = weakref.WeakSet()


def inherited(obj):
    """Is `obj` a file object this fork inherited (its buffer holds another process's output)?"""
    return obj in _inherited_files


_default_threads = []   # torch's thread count in the warm process with no OMP_NUM_THREADS set


def import_torch_counting_threads(modules):
    """Import `modules` (torch first) as a new process would, and note the thread count torch
    takes when OMP_NUM_THREADS is unset: with MKL, ATen's init_num_threads sets OpenMP's count
    to mkl_get_max_threads(), and MKL (MKL_DYNAMIC, its default) takes OMP_NUM_THREADS only up
    to the cores it counts; that count is this default. Then this process takes its own
    OMP_NUM_THREADS as a new one would (apply_thread_count)."""
    import importlib
    saved = os.environ.pop("OMP_NUM_THREADS", None)
    try:
        torch = importlib.import_module("torch")
        _default_threads.append(torch.get_num_threads())
    finally:
        if saved is not None:
            os.environ["OMP_NUM_THREADS"] = saved
    for name in modules:
        importlib.import_module(name)
    apply_thread_count(torch)
    return torch


def apply_thread_count(torch):
    """torch's thread count from this process's OMP_NUM_THREADS, as `import torch` sets it in a
    new process: the number; where MKL counts threads, no more than MKL's own count (the
    measured default: MKL_DYNAMIC caps it), or MKL_NUM_THREADS's where that is set (MKL_*
    variables that differ from the warm process's make a launch cold: they are the same here)."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if not (threads.isdigit() and int(threads) > 0):
        return
    n = int(threads)
    if _default_threads and torch.backends.mkl.is_available():
        if os.environ.get("MKL_NUM_THREADS"):   # MKL's own variable wins: the default is its count
            n = _default_threads[0]
        elif os.environ.get("MKL_DYNAMIC", "").upper() not in ("FALSE", "0", "NO", "N"):
            n = min(n, _default_threads[0])
    torch.set_num_threads(n)


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


def shed_inheritance():
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
    if torch is not None:
        apply_thread_count(torch)
    import tempfile
    tempfile.tempdir = None   # found again from this launch's TMPDIR, as a new process would
