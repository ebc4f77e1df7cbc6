"""`python -m ddp_lesson.rank.guard`, what torchrun runs for every rank, and `python -m
ddp_lesson.rank.agent`, what the launcher runs torchrun under.

Checked directly (no torchrun, so these are fast):

- parent-death guard: when the guard's parent is SIGKILLed, the guarded process ends
  by itself within a few seconds (SIGKILL by default, the chosen signal with --signal);
- in a rank (RANK and DDP_LESSON_RUN_DIR set) stdout/stderr go to
  logs/rank<R>.stdout.log / .stderr.log;
- an exception in the script writes logs/rank<R>.error.json with the message and the
  script's own traceback (not the guard's or runpy's frames), also for a script without
  @record, and torchrun's TORCHELASTIC_ERROR_FILE in torchrun's format; a non-zero
  sys.exit is recorded too, and the exit status is kept;
- the script runs as __main__ with its own folder first on sys.path; `-m module` works.
"""
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import child_env, wait_until

GUARD = [sys.executable, "-m", "ddp_lesson.rank.guard"]


def guard_env(**extra):
    return child_env(**extra)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [None, "TERM"])
def test_guarded_process_ends_when_its_parent_is_killed(tmp_path, write_script, sig):
    child = write_script("child.py", """
        import os, signal, sys, time
        if len(sys.argv) > 1:  # report the signal that ended us, if it can be caught
            signal.signal(signal.SIGTERM, lambda *a: (open(sys.argv[1], "w").write("TERM"), os._exit(143)))
        print(os.getpid(), flush=True)
        time.sleep(120)
    """)
    marker = tmp_path / "got_signal"
    guard = GUARD + (["--signal", sig] if sig else []) + [str(child)] + ([str(marker)] if sig else [])
    # the parent: starts the guard, says its pid, and sleeps until it is killed
    parent_src = ("import subprocess, sys, time; p = subprocess.Popen(sys.argv[1:]); "
                  "print(p.pid, flush=True); time.sleep(120)")
    out = tmp_path / "parent.out"
    with open(out, "w") as f:
        parent = subprocess.Popen([sys.executable, "-c", parent_src, *guard], stdout=f,
                                  env=guard_env(), cwd=tmp_path)
    try:
        got = wait_until(lambda: len(out.read_text().split()) >= 2, 30)
        assert got, "the guarded script never started"
        guarded = int(out.read_text().split()[0])
        assert psutil.pid_exists(guarded)
        t0 = time.monotonic()
        parent.kill()
        parent.wait()
        gone = wait_until(lambda: not psutil.pid_exists(guarded)
                          or psutil.Process(guarded).status() == psutil.STATUS_ZOMBIE, 10)
        elapsed = time.monotonic() - t0
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        try:
            psutil.Process(int(out.read_text().split()[0])).kill()
        except (psutil.Error, ValueError, IndexError):
            pass
    assert gone, "the guarded process outlived its parent"
    assert elapsed < 5
    if sig == "TERM":
        assert marker.read_text() == "TERM"


def run_rank(script, run_dir, *args, rank="1", extra_env=None):
    env = guard_env(DDP_LESSON_RUN_DIR=run_dir, RANK=rank, **(extra_env or {}))
    return subprocess.run(GUARD + [str(script), *args], env=env, capture_output=True, text=True,
                          timeout=60, cwd=run_dir)


@pytest.mark.timeout(60)
def test_rank_output_goes_to_log_files_and_errors_are_recorded(tmp_path, write_script):
    script = write_script("bad.py", """
        import sys
        def inner():
            raise KeyError("missing thing")
        print("to stdout", flush=True)
        print("to stderr", file=sys.stderr, flush=True)
        print("argv", sys.argv[1:], "main", __name__, "path0", sys.path[0], flush=True)
        inner()
    """)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    err_file = tmp_path / "torchelastic_error.json"
    p = run_rank(script, run_dir, "--flag", "x", extra_env={"TORCHELASTIC_ERROR_FILE": err_file})
    assert p.returncode == 1
    assert p.stdout == ""  # all of it went to the rank's log files
    out = (run_dir / "logs" / "rank1.stdout.log").read_text()
    assert "to stdout" in out and f"argv ['--flag', 'x'] main __main__ path0 {tmp_path}" in out
    err = (run_dir / "logs" / "rank1.stderr.log").read_text()
    assert "to stderr" in err and "KeyError" in err  # the usual traceback still printed
    record = json.loads((run_dir / "logs" / "rank1.error.json").read_text())
    assert record["rank"] == 1 and record["message"] == "KeyError: 'missing thing'"
    assert record["restart"] == 0 and abs(record["time"] - time.time()) < 60
    tb = record["traceback"]
    assert tb.startswith("Traceback") and "in inner" in tb and str(script) in tb
    assert "runpy" not in tb and "guard.py" not in tb
    elastic = json.loads(err_file.read_text())
    assert elastic["message"]["message"] == "KeyError: 'missing thing'"
    assert "in inner" in elastic["message"]["extraInfo"]["py_callstack"]


@pytest.mark.timeout(60)
def test_nonzero_sys_exit_is_recorded_and_zero_is_not(tmp_path, write_script):
    script = write_script("ex.py", "import sys\nsys.exit(int(sys.argv[1]))\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert run_rank(script, run_dir, "0").returncode == 0
    assert not (run_dir / "logs" / "rank1.error.json").exists()
    assert run_rank(script, run_dir, "3").returncode == 3
    record = json.loads((run_dir / "logs" / "rank1.error.json").read_text())
    assert "status 3" in record["message"]


@pytest.mark.timeout(60)
def test_outside_a_rank_the_guard_only_runs_the_target(tmp_path, write_script):
    script = write_script("ok.py", "print('plain run', __name__)\n")
    p = subprocess.run(GUARD + [str(script)], env=guard_env(), capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert p.returncode == 0 and p.stdout == "plain run __main__\n"
    assert not (tmp_path / "logs").exists()
    (tmp_path / "mod_here.py").write_text("import sys\nprint('module', __name__, sys.argv[1:])\n")
    p = subprocess.run(GUARD + ["-m", "mod_here", "a"], env=guard_env(PYTHONPATH=f"{tmp_path}{os.pathsep}"
                                                                     f"{child_env()['PYTHONPATH']}"),
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert p.returncode == 0 and p.stdout == "module __main__ ['a']\n", p.stderr


def test_usage_without_target():
    p = subprocess.run(GUARD, env=guard_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "usage" in p.stderr


def test_script_dir_is_importable(tmp_path, write_script):
    """script.py runs from the run directory; modules beside the original script still import."""
    (tmp_path / "helper_mod.py").write_text("VALUE = 42\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "script.py").write_text("import helper_mod\nprint(helper_mod.VALUE)\n")
    p = subprocess.run(GUARD + [str(run_dir / "script.py")], capture_output=True, text=True,
                       env=guard_env(DDP_LESSON_SCRIPT_DIR=tmp_path), timeout=60, cwd=run_dir)
    assert p.returncode == 0 and p.stdout == "42\n", p.stderr


@pytest.mark.timeout(60)
def test_a_finished_distributed_rank_exits_0_with_atexit_run_and_files_flushed(tmp_path, write_script):
    """A rank that imported torch.distributed skips the interpreter's finalization (where
    gloo's threads can abort the process at random); what finalization would do for the
    script still happens: atexit handlers run, files left open are flushed."""
    script = write_script("finish.py", """
        import atexit, os, sys
        import torch.distributed as dist
        store = dist.FileStore(sys.argv[1], 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        dist.destroy_process_group()
        left_open = open(sys.argv[2], "w")
        left_open.write("all of it")  # never closed, never flushed by the script
        atexit.register(lambda: open(sys.argv[3], "w").write("atexit ran"))
        print("done", flush=True)
    """)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    data, marker = tmp_path / "data.txt", tmp_path / "atexit.txt"
    p = run_rank(script, run_dir, str(tmp_path / "store"), str(data), str(marker))
    assert p.returncode == 0, (run_dir / "logs" / "rank1.stderr.log").read_text()
    assert data.read_text() == "all of it"
    assert marker.read_text() == "atexit ran"
    assert "done" in (run_dir / "logs" / "rank1.stdout.log").read_text()


# -- issue 10: the guard in each process ----------------------------------------------------

def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.timeout(60)
@pytest.mark.parametrize("entry", [["ddp_lesson.rank.agent"], ["ddp_lesson.rank.guard", "--rank"]])
def test_parent_already_gone_means_exit_at_once(tmp_path, write_script, entry):
    """A launcher killed right after start() may be gone before the guard arms prctl: the
    guard is told its expected parent and exits without running anything."""
    marker = tmp_path / "ran"
    script = write_script("t.py", f"open({str(marker)!r}, 'w').write('ran')\n")
    p = subprocess.run([sys.executable, "-m", *entry, "--parent", str(_dead_pid()), str(script)], env=guard_env(),
                       capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert p.returncode != 0 and not marker.exists(), p.stderr


@pytest.mark.timeout(60)
def test_a_rank_expects_the_agent_as_parent(tmp_path, write_script):
    marker = tmp_path / "ran"
    script = write_script("t.py", f"open({str(marker)!r}, 'w').write('ran')\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = guard_env(DDP_LESSON_RUN_DIR=run_dir, RANK="0", DDP_LESSON_AGENT_PID=_dead_pid())
    p = subprocess.run(GUARD + ["--rank", str(script)], env=env, capture_output=True, timeout=30)
    assert p.returncode != 0 and not marker.exists()


@pytest.mark.timeout(60)
def test_parent_death_signal_is_sent_once(tmp_path, write_script):
    """torchrun tears down in its SIGTERM handler; a second SIGTERM from the guard would
    interrupt that teardown half-way (its workers' children then survive)."""
    log = tmp_path / "signals"
    child = write_script("child.py", f"""
        import os, signal, sys, time
        def on_term(*_):
            open({str(log)!r}, "a").write("T")
            time.sleep(2)  # a teardown that takes a while
            os._exit(0)
        signal.signal(signal.SIGTERM, on_term)
        print(os.getpid(), flush=True)
        time.sleep(60)
    """)
    parent_src = ("import subprocess, sys, time; p = subprocess.Popen(sys.argv[1:]); "
                  "print(p.pid, flush=True); time.sleep(120)")
    out = tmp_path / "parent.out"
    with open(out, "w") as f:
        parent = subprocess.Popen([sys.executable, "-c", parent_src, *GUARD, "--signal", "TERM", str(child)],
                                  stdout=f, env=guard_env(), cwd=tmp_path)
    try:
        assert wait_until(lambda: len(out.read_text().split()) >= 2, 30)
        guarded = int(out.read_text().split()[0])
        parent.kill()
        parent.wait()
        assert wait_until(lambda: not psutil.pid_exists(guarded)
                          or psutil.Process(guarded).status() == psutil.STATUS_ZOMBIE, 10)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    assert log.read_text() == "T"


DAEMON = """
import os, sys, time
# a rank's helper that leaves the tree: double fork into a new session
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        with open(sys.argv[1] + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(sys.argv[1] + ".tmp", sys.argv[1])
        time.sleep(120)
    os._exit(0)
# leave once the daemon has said its pid (on a busy machine that may take a while)
end = time.monotonic() + 30
while not os.path.exists(sys.argv[1]) and time.monotonic() < end:
    time.sleep(0.02)
"""


@pytest.mark.timeout(60)
def test_agent_guard_ends_descendants_that_left_the_tree(tmp_path, write_script):
    """The agent's guard is a child subreaper and sweeps its subtree when it ends."""
    pid_file = tmp_path / "daemon.pid"
    script = write_script("spawns.py", DAEMON)
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    p = subprocess.run([sys.executable, "-m", "ddp_lesson.rank.agent", "--signal", "TERM", str(script), str(pid_file)],
                       env=guard_env(DDP_LESSON_RUN_DIR=run_dir, DDP_LESSON_RUN_TOKEN="t1"),
                       capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    daemon = int(pid_file.read_text())
    try:
        assert wait_until(lambda: not psutil.pid_exists(daemon)
                          or psutil.Process(daemon).status() == psutil.STATUS_ZOMBIE, 5)
    finally:
        if psutil.pid_exists(daemon):
            psutil.Process(daemon).kill()


@pytest.mark.timeout(60)
def test_tracebacks_start_at_the_learners_frames_once(tmp_path, write_script):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    bad = write_script("syntax.py", "x = (1,\nprint('never')\n")
    assert run_rank(bad, run_dir, rank="0").returncode == 1
    err = (run_dir / "logs" / "rank0.stderr.log").read_text()
    assert "SyntaxError" in err and "guard.py" not in err and "runpy" not in err, err
    raises = write_script("raises.py", "def f():\n    raise KeyError('k')\nf()\n")
    assert run_rank(raises, run_dir, rank="2").returncode == 1
    err = (run_dir / "logs" / "rank2.stderr.log").read_text()
    assert err.count("Traceback") == 1 and err.count("KeyError: 'k'") == 1, err
    assert "guard.py" not in err and "runpy" not in err


@pytest.mark.timeout(90)
def test_a_distributed_rank_exits_with_its_status_and_prints_no_warnings(tmp_path, write_script):
    """sys.exit(3) after init_process_group is 3, not -6 from the interpreter's finalization;
    the guard's own exit path prints no deprecation warnings."""
    script = write_script("exit3.py", """
        import sys
        import torch.distributed as dist
        dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
        if sys.argv[2] == "3":
            sys.exit(3)
        dist.destroy_process_group()
    """)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    p = run_rank(script, run_dir, str(tmp_path / "s1"), "3", rank="0")
    assert p.returncode == 3
    p = run_rank(script, run_dir, str(tmp_path / "s2"), "0", rank="1")
    assert p.returncode == 0
    err = (run_dir / "logs" / "rank1.stderr.log").read_text()
    assert "Warning" not in err, err


@pytest.mark.timeout(60)
def test_a_rank_tells_where_it_is_on_sigusr1(tmp_path, write_script):
    """What the launcher uses to say where each rank was when a run timed out."""
    from ddp_lesson.launcher import stacks
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "script.py").write_text("import time\nprint('ready', flush=True)\nwhile True:\n    time.sleep(0.1)\n")
    env = guard_env(DDP_LESSON_RUN_DIR=run_dir, RANK="0")
    p = subprocess.Popen(GUARD + ["--rank", str(run_dir / "script.py")], env=env, cwd=run_dir)
    try:
        assert wait_until(lambda: "ready" in (run_dir / "logs" / "rank0.stdout.log").read_text()
                          if (run_dir / "logs" / "rank0.stdout.log").exists() else False, 30)
        p.send_signal(signal.SIGUSR1)
        # a dump is read whole once it reaches the top level (stacks.where says "complete")
        where = wait_until(lambda: (w := stacks.where(run_dir, 1)) and w[0]["complete"] and w, 10)
    finally:
        p.kill()
        p.wait()
    assert where == {0: {"state": "busy", "call": None, "at": "script.py line 4", "complete": True}}
