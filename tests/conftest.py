"""Shared fixtures for the test suite: small and generic.

- `tmp_run_dir`: a path for a run directory that does not exist yet (inside tmp_path).
- `write_script`: writes a Python script into tmp_path and returns its path.
- `repo_env`: an environment for child processes that can import ddp_lesson from this
  checkout, without any DDP_LESSON_* variables inherited from the caller.
- `kernel_sigint`: SIGINT raises KeyboardInterrupt during the test, whatever was inherited.
- `launch_mode` (module scope, "warm" then "cold") and `launches_went_that_way`: a test module
  that uses both (`pytestmark = pytest.mark.usefixtures(...)`) runs every test with warm launches
  and again cold (DDP_LESSON_COLD=1, which its child launchers inherit), and fails a test whose
  runs under tmp_path went the other way.
- `signal_points(fn, at=...)`: runs fn() with an Interrupt delivered at one chosen point
  where CPython could deliver it, so code can be checked against every such point in turn.
- `no_leftover_processes` (autouse): after every test, no process of a run whose run
  directory lies under this session's pytest temp folder may still be alive (waits a few
  seconds for them to go, then kills them and fails the test). Processes are found by the
  run's identity (procs.run_processes: its environment, its pid files), never by name, so
  other people's runs on the same machine are never touched.
"""
import dis
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from ddp_lesson.rank import procs

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def _processes_under(base):
    base = os.path.abspath(base) + os.sep
    return [p for run_dir, ps in procs.by_run(verify=False).items() if (run_dir + os.sep).startswith(base)
            for p in ps if procs.alive(p)]


def processes_under(base):
    """Live processes of the runs whose run directory is `base` or below it (procs.run_processes)."""
    return _processes_under(base)


def wait_until(predicate, timeout, interval=0.05):
    """Poll `predicate` until it returns something truthy (returned) or `timeout` passes (None)."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= end:
            return None
        time.sleep(interval)


# the calls after which CPython checks for a pending signal: CALL (3.11-3.13), CALL_KW (3.13's
# call with keywords; 3.11 and 3.12: KW_NAMES, then CALL), and 3.10's CALL_FUNCTION,
# CALL_METHOD and CALL_FUNCTION_KW (each ends in CHECK_EVAL_BREAKER there)
CALLS = ("CALL", "CALL_KW", "CALL_FUNCTION", "CALL_METHOD", "CALL_FUNCTION_KW")


@functools.lru_cache(maxsize=None)
def _call_offsets(code):
    return {i.offset for i in dis.get_instructions(code) if i.opname in CALLS}


def signal_points(fn, at=None, where=lambda code: True, handler=None):
    """Run fn() and count the points where CPython (3.10 to 3.13) handles a pending signal: a
    function's start (RESUME; 3.10: its first instruction) and right after a call returns (a
    call checks for pending signals once the callee is done: CALLS), in frames whose code
    `where` accepts. At point `at`,
    do what a SIGINT arriving there does: call `handler`, or else the handler SIGINT has at
    that moment (default_int_handler raises KeyboardInterrupt; a holder notes it). A
    KeyboardInterrupt that comes out of fn() is swallowed when `at` is given. Returns how
    many points there were. Deterministic: no timing decides where the Interrupt lands.

    A model, not CPython itself: it also counts points CPython skips (after a call into
    Python code returns, after some builtins), which only makes a walk stricter, and it
    misses some it has (loop back-edges, f(*args) calls, checks inside C calls such as
    signal.signal), so a walk that passes is strong evidence, not proof."""
    count, last = [0], {}

    def point(frame):
        count[0] += 1
        if count[0] == at:
            h = handler or signal.getsignal(signal.SIGINT)
            if callable(h):
                h(signal.SIGINT, frame)

    def tracer(frame, event, arg):
        if not where(frame.f_code):
            return None
        if event == "call":
            # opcode events from this frame's first instruction on, as 3.11 gives them: 3.13
            # instruments the code only for a frame whose f_trace is already set, and 3.12 only
            # where some frame asked for opcodes before sys.settrace (see below); otherwise the
            # first call of each function shows none and the walk misses most of its points
            frame.f_trace = tracer
            frame.f_trace_opcodes = True
            point(frame)
        elif event == "opcode":
            # moved on before point() may raise: the frame's unwinding is not a new point
            previous, last[frame] = last.get(frame), frame.f_lasti
            if previous in _call_offsets(frame.f_code):
                point(frame)
        return tracer

    me = sys._getframe()
    me.f_trace_opcodes = True   # 3.12: sys.settrace then instruments opcode events everywhere
    sys.settrace(tracer)
    try:
        fn()
    except KeyboardInterrupt:
        if at is None:
            raise
    finally:
        sys.settrace(None)
        me.f_trace_opcodes = False
    return count[0]


def ipython_cells():
    """An IPython shell with `%load_ext ddp_lesson` done, and cell(source) -> (result,
    captured output), which runs one cell in it."""
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "ddp_lesson")

    def cell(source):
        with capture_output() as cap:
            res = ip.run_cell(source)
        return res, cap
    return ip, cell


def child_env(**extra):
    """An environment for a child process: this checkout importable, no DDP_LESSON_* variable
    inherited but DDP_LESSON_COLD (a test of cold launches runs its launchers cold too)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDP_LESSON_") or k == "DDP_LESSON_COLD"}
    env.pop("MASTER_PORT", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def plain_torchrun(script, *args, nproc=2, env=None, cwd=None, timeout=240):
    """`torchrun --standalone --nproc-per-node N SCRIPT ARGS` with no course launcher around it
    (the reference a test compares with); its output as text. env: child_env() by default."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(script), *map(str, args)]
    return subprocess.run(cmd, env=child_env() if env is None else env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def cli(*args):
    """argv for the command line in a fresh interpreter."""
    return [sys.executable, "-m", "ddp_lesson", *map(str, args)]


@pytest.fixture(scope="module", params=["warm", "cold"])
def launch_mode(request):
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "cold":
            mp.setenv("DDP_LESSON_COLD", "1")
        else:
            mp.delenv("DDP_LESSON_COLD", raising=False)
        yield request.param


@pytest.fixture
def launches_went_that_way(launch_mode, tmp_path):
    yield
    for config in tmp_path.rglob("config.json"):
        launched = json.loads(config.read_text()).get("launch")
        if launched is not None:   # a config.json a test wrote itself has none
            assert launched["mode"] == launch_mode, f"{config}: launched {launched['mode']}, not {launch_mode}"


@pytest.fixture
def tmp_run_dir(tmp_path):
    return tmp_path / "run"


@pytest.fixture
def write_script(tmp_path):
    def write(name, source):
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return path
    return write


@pytest.fixture
def repo_env():
    return child_env()


@pytest.fixture
def kernel_sigint():
    """SIGINT raises KeyboardInterrupt here, as a notebook's Interrupt does in a kernel,
    whatever this process inherited (a background job starts with SIGINT ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(autouse=True)
def no_leftover_processes(tmp_path_factory):
    yield
    base = tmp_path_factory.getbasetemp()
    left = wait_until(lambda: not _processes_under(base), timeout=10, interval=0.2)
    if left is None:
        stragglers = _processes_under(base)
        desc = [(p.pid, " ".join(p.cmdline()[:6])) for p in stragglers if procs.alive(p)]
        procs.kill_all(stragglers)  # ours: their run directory is in our temp folder
        pytest.fail(f"processes of a run were left behind: {desc}")


@pytest.fixture(scope="module")
def runs_base():
    """A runs folder for one module's live worlds, outside pytest's temp folder: the
    worlds live across tests, which no_leftover_processes would fail; this fixture
    checks instead, at the module's end, that nothing of any world is left running."""
    base = Path(tempfile.mkdtemp(prefix="ddp-lesson-world-"))
    old = os.environ.get("DDP_LESSON_RUNS")
    os.environ["DDP_LESSON_RUNS"] = str(base)
    yield base
    if old is None:
        os.environ.pop("DDP_LESSON_RUNS", None)
    else:
        os.environ["DDP_LESSON_RUNS"] = old
    left = [p for run_dir in base.iterdir() for p in procs.run_processes(run_dir)]
    procs.kill_all(left)
    shutil.rmtree(base, ignore_errors=True)
    assert not left, f"processes of a world were left behind: {left}"


@pytest.fixture(scope="module")
def world(runs_base):
    """One live world of the default rank count, shared by a module's tests."""
    from ddp_lesson.launcher import world as world_mod
    w = world_mod.start(cpu=True, timeout=60)
    yield w
    w.stop()
