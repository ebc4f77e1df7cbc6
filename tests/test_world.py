"""The live world (ddp_lesson.launcher.world) and its magics, with real torchrun ranks on gloo.

One module-scoped world serves most tests (starting one costs seconds); the tests that
must kill or restart a world come last and use their own where they can. The rank count
is the default (DDP_LESSON_NPROC, else 2): expectations come from world.world_size.
"""
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing.connection import Client

import pytest

from conftest import child_env, ipython_cells, signal_points, wait_until
from ddp_lesson.rank import procs
from ddp_lesson.launcher import world as world_mod

# these tests interrupt world.run() as a notebook's Interrupt would
pytestmark = pytest.mark.usefixtures("kernel_sigint")


def test_names_persist_and_each_rank_answers(world):
    n = world.world_size
    assert n >= 1 and sorted(world.pids) == list(range(n))
    world.run("x = rank * 10")
    res = world.run("print('hello from', rank)\nx + 1")
    assert [r.rank for r in res] == list(range(n))
    assert [r.value for r in res] == [str(r * 10 + 1) for r in range(n)]
    assert [r.stdout for r in res] == [f"hello from {r}\n" for r in range(n)]
    assert all(r.error is None and r.stderr == "" for r in res)
    res = world.run("import sys; print('warn', file=sys.stderr)\n"
                    "(world_size, str(device), dist.get_rank() == rank, torch.__name__)")
    assert [r.value for r in res] == [repr((n, "cpu", True, "torch"))] * n
    assert [r.stderr for r in res] == ["warn\n"] * n
    assert world.run("y = 1")[0].value is None  # no trailing expression, no value


def test_all_reduce_result_on_every_rank(world):
    n = world.world_size
    res = world.run("t = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\nt.item()")
    assert [float(r.value) for r in res] == [n * (n + 1) / 2] * n


def test_exception_on_one_rank_shows_its_traceback_and_world_goes_on(world):
    last = world.world_size - 1
    res = world.run("def boom():\n    return 1 / 0\nboom() if rank == %d else 'fine'" % last)
    err = res[last].error
    assert "ZeroDivisionError" in err and "in boom" in err and "return 1 / 0" in err
    assert "world_rank" not in err and "script.py" not in err  # only the learner's frames
    assert all(r.error is None and r.value == "'fine'" for r in res[:last])
    syntax = world.run("def (:")
    assert all("SyntaxError" in r.error for r in syntax)
    assert [r.value for r in world.run("x")] == [str(r * 10) for r in range(world.world_size)]


def test_ranks_subset_and_bad_ranks(world):
    n = world.world_size
    assert [r.rank for r in world.run("rank", ranks=[0])] == [0]
    assert [r.rank for r in world.run("rank", ranks=0)] == [0]
    with pytest.raises(ValueError, match=f"Rank {n} does not exist: this world has ranks 0-{n - 1}"):
        world.run("z = 1", ranks=[0, n])
    with pytest.raises(ValueError, match="whole numbers"):
        world.run("z = 1", ranks=["a"])
    # nothing was sent: z is not defined anywhere
    assert all("NameError" in r.error for r in world.run("z"))


def test_output_streams_while_the_cell_runs(world):
    seen = []
    code = "import time\nprint('a', rank)\ntime.sleep(1.5)\nprint('b', rank)"
    world.run(code, ranks=[0], on_output=lambda r, s, t: seen.append((time.monotonic(), r, s, t)))
    assert [x[1:] for x in seen] == [(0, "stdout", "a 0\n"), (0, "stdout", "b 0\n")]
    assert seen[1][0] - seen[0][0] > 0.7  # 'a' came before the cell ended


def test_interrupt_stops_python_code_and_keeps_the_world(world):
    timer = threading.Timer(0.7, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        world.run("import time\nfor _ in range(300): time.sleep(0.1)")
    timer.join()
    assert world.state == "ready"
    assert [r.value for r in world.run("rank")] == [str(r) for r in range(world.world_size)]



def test_an_interrupt_anywhere_in_run_leaves_the_world_usable(world):
    """Ctrl-C may land at any point of the kernel's side of a call. conftest.signal_points
    puts it, in turn, on every point of ddp_lesson/launcher/world.py's code that one call passes
    where CPython would deliver it; after each, the world is ready and the next call runs
    (a lock left taken said "This world is running another call" until a restart)."""
    n = world.world_size
    mine = lambda code: code.co_filename == world_mod.__file__
    steps = signal_points(lambda: world.run("rank"), where=mine)
    assert steps >= 10
    interrupted = 0
    for step in range(1, steps + 1):
        t = time.monotonic()
        try:
            signal_points(lambda: world.run("rank"), at=step, where=mine)
        except RuntimeError as e:   # only the message this test is about
            pytest.fail(f"an Interrupt at point {step} of {steps}: {e}")
        assert time.monotonic() - t < world_mod.INTERRUPT_GRACE_S + 5, step
        assert world.state == "ready", (step, world.describe())
        assert [r.value for r in world.run("rank", timeout=30)] == [str(r) for r in range(n)], step
        interrupted += 1
    assert interrupted == steps

def test_key_file_private_and_listener_closed(world):
    key = world.run_dir / "world.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert key.read_bytes() not in (world.run_dir / "config.json").read_bytes()
    with pytest.raises(OSError):  # every rank is in; nobody else can connect
        Client(world.address, authkey=key.read_bytes())


def test_two_worlds_do_not_mix(world):
    with world_mod.start(nproc=1, cpu=True) as other:
        assert other.run_dir != world.run_dir and other.address != world.address
        assert not set(other.pids.values()) & set(world.pids.values())
        other.run("x = 'other'")
        assert other.run("x")[0].value == "'other'"
        assert world.run("x", ranks=[0])[0].value == "0"
        assert other.world_size == 1
    assert not procs.run_processes(other.run_dir)
    assert world.state == "ready"


def test_hung_collective_times_out_then_restart(world):
    n = world.world_size
    if n < 2:
        pytest.skip("a collective only some ranks enter needs 2 ranks or more")
    old_dir = world.run_dir
    t = time.monotonic()
    with pytest.raises(TimeoutError, match=r"Rank 0 did not finish within 2 s.*must restart"):
        world.run("dist.barrier()", ranks=[0], timeout=2)
    assert time.monotonic() - t < 10
    assert world.state == "needs restart"
    with pytest.raises(RuntimeError, match="cannot run more code.*Restart it"):
        world.run("1")
    t = time.monotonic()
    world.stop()        # a rank blocked in a collective: killed, not waited for
    took = time.monotonic() - t
    assert not procs.run_processes(old_dir), "the hung world left processes behind"
    assert took < 10, f"stopping a hung world took {took:.1f} s"
    world.restart()     # a stopped world starts afresh
    assert world.run_dir != old_dir and world.state == "ready"
    assert [r.value for r in world.run("'x' in dir()")] == ["False"] * n  # a fresh namespace


def test_stop_ends_everything(world):
    run_dir = world.run_dir
    assert procs.run_processes(run_dir)
    world.stop()
    assert world.state == "stopped"
    assert wait_until(lambda: not procs.run_processes(run_dir), timeout=5) is not None
    with pytest.raises(RuntimeError, match="was stopped"):
        world.run("1")


def test_killed_kernel_leaves_no_rank(tmp_path):
    owner = textwrap.dedent("""
        import time
        from ddp_lesson.launcher import world
        w = world.start(nproc=2, cpu=True)
        print(w.run_dir, flush=True)
        time.sleep(120)
    """)
    p = subprocess.Popen([sys.executable, "-c", owner], cwd=tmp_path, stdout=subprocess.PIPE,
                         text=True, env=child_env(DDP_LESSON_RUNS=tmp_path / "runs"))
    try:
        run_dir = p.stdout.readline().strip()
        assert run_dir, "the owner did not start its world"
        assert len([q for q in procs.run_processes(run_dir)]) >= 3  # agent + 2 ranks
    finally:
        p.kill()
        p.wait()
    t = time.monotonic()
    gone = wait_until(lambda: not procs.run_processes(run_dir), timeout=10, interval=0.1)
    assert gone is not None, f"ranks alive 10 s after the kernel was killed: {procs.run_processes(run_dir)}"
    print(f"all gone {time.monotonic() - t:.1f} s after SIGKILL")


def test_magics(runs_base):
    from ddp_lesson.notebook import magics

    ip, cell = ipython_cells()

    res, _ = cell("%%ranks\n1")
    assert "%ranks start" in str(res.error_in_exec)
    res, _ = cell("%ranks start --cpu --bogus")
    assert "Unrecognized arguments: --bogus." in str(res.error_in_exec)
    res, cap = cell("%ranks start --cpu")
    assert res.success, res.error_in_exec
    w = magics.current_world()
    n = w.world_size
    assert "ready" in cap.outputs[-1].data["text/plain"]
    try:
        res, cap = cell("%%ranks\nt = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\nprint('r', rank)\nt.item()")
        assert res.success, res.error_in_exec
        assert [float(r.value) for r in ip.user_ns["_ranks"]] == [n * (n + 1) / 2] * n
        text, page = cap.outputs[-1].data["text/plain"], cap.outputs[-1].data["text/html"]
        for r in range(n):
            assert f"[rank {r}] r {r}" in text and f"[rank {r}] Out: {n * (n + 1) / 2}" in text
            assert f"rank {r}</div>" in page
        res, cap = cell("%%ranks 0\nrank")
        assert [r.rank for r in ip.user_ns["_ranks"]] == [0]
        res, cap = cell(f"%%ranks 0-{n - 1}\n1 / (rank - {n - 1})")
        assert f"Rank {n - 1} raised an exception" in str(res.error_in_exec)
        assert "#cf222e" in cap.outputs[-1].data["text/html"]          # errors in red
        assert "ZeroDivisionError" in cap.outputs[-1].data["text/plain"]
        res, _ = cell(f"%%ranks {n}\n1")
        assert f"Rank {n} does not exist" in str(res.error_in_exec)
        res, _ = cell("%%ranks 0,x\n1")
        assert "RANKS must look like 0,2 or 0-2" in str(res.error_in_exec)
        res, cap = cell("%ranks status")
        assert "ready" in cap.stdout
        # the Stop button ends everything, as %ranks stop does
        status = magics.WorldStatus(w)
        status.stop_button.click()
        assert wait_until(lambda: w.state == "stopped", timeout=15)
        assert wait_until(lambda: not procs.run_processes(w.run_dir), timeout=5) is not None
        res, _ = cell("%%ranks\n1")
        assert "%ranks start" in str(res.error_in_exec)
        res, cap = cell("%ranks stop")
        assert res.success
    finally:
        w.stop()
