"""The command line `python -m ddp_lesson ...`, run as a user runs it, in a fresh process.

Pins down the exit-status contract and what gets printed:

- bad input (`--nproc 0|-1|abc`, a missing script, `--gpus 0` with no GPU, a run directory
  that is a file, a negative `--timeout` or `--max-restarts`): exit 2, exactly one line on
  stderr, no traceback, no process started and no run directory created;
- Ctrl-C (SIGINT to the command's process group, as a terminal sends it): every process
  of the run is gone within 10 s, status `interrupted`, exit 130; started with SIGINT
  ignored (a background job), it stays ignored and SIGTERM ends the run the same way;
- a rank that raises (a plain script without @record, and one with it): exit 1 within 60 s, the other rank is
  torn down, and both the printed output and result.json name rank 1 as the first
  failure, with its traceback;
- a rank that never reaches a collective: status `timeout` at the configured --timeout,
  said plainly, exit 1;
- `cleanup` ends the processes of a leftover run and touches nothing else (run inside a
  private PID namespace so it cannot reach other people's runs on a shared machine);
- `demo --epochs 2` exits 0 and reports a test accuracy far above chance (10%).
"""
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import SCRIPTS, child_env, cli, processes_under, wait_until
from ddp_lesson.rank import procs

pytestmark = pytest.mark.usefixtures("launch_mode", "launches_went_that_way")  # warm, then cold


def run_cli(args, cwd, timeout=120):
    return subprocess.run(cli(*args), cwd=cwd, env=child_env(), capture_output=True, text=True,
                          timeout=timeout)


# -- bad input -------------------------------------------------------------------------------

BAD = {
    "nproc-0": (["--nproc", "0"], "at least 1"),
    "nproc-negative": (["--nproc", "-1"], "at least 1"),
    "nproc-not-a-number": (["--nproc", "abc"], "whole number"),
    "missing-script": (None, "does not exist"),
    "gpus-without-gpu": (["--gpus", "0"], "GPU"),
    "run-dir-is-a-file": ("file", "is a file"),
    "negative-timeout": (["--timeout", "-5"], "--timeout"),
    "negative-max-restarts": (["--max-restarts", "-1"], "--max-restarts"),
    "nan-timeout": (["--timeout", "nan"], "finite"),
    "inf-timeout": (["--timeout", "inf"], "finite"),
    "nproc-far-beyond-the-machine": (["--nproc", "100000"], "DDP_LESSON_MAX_CPU_RANKS"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_exits_2_with_one_line(case, tmp_path):
    extra, expected = BAD[case]
    script = str(SCRIPTS / "sleeper.py")
    run_dir = tmp_path / "run"
    if case == "gpus-without-gpu" and shutil.which("nvidia-smi"):
        extra = ["--gpus", "99"]  # a GPU id that does not exist here either
    if extra is None:
        args = ["run", str(tmp_path / "no_such_script.py"), "--run-dir", run_dir]
    elif extra == "file":
        run_dir.write_text("not a folder")
        args = ["run", script, "--run-dir", run_dir]
    else:
        args = ["run", script, *extra, "--run-dir", run_dir]
    before = sorted(p.name for p in tmp_path.iterdir())
    t0 = time.monotonic()
    out = run_cli(args, cwd=tmp_path, timeout=50)
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr and expected in lines[0]
    assert lines[0].startswith("ddp_lesson: ") and lines[0].endswith(".")
    assert out.stdout == ""
    # nothing was created: no run directory (the default runs/ included) and no process
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    if extra == "file":
        assert run_dir.read_text() == "not a folder"
    assert not processes_under(tmp_path)
    assert time.monotonic() - t0 < 30  # found before anything starts


# -- Ctrl-C ----------------------------------------------------------------------------------

def ranks_ready(run_dir, nproc=2):
    logs = [run_dir / "logs" / f"rank{r}.stdout.log" for r in range(nproc)]
    return lambda: all(f.exists() and "ready" in f.read_text() for f in logs)


def _ignored_signals(pid):
    mask = next(line.split()[1] for line in open(f"/proc/{pid}/status") if line.startswith("SigIgn:"))
    return {signal.Signals(n + 1) for n in range(64) if int(mask, 16) >> n & 1 and n + 1 in
            signal.valid_signals()}


@contextlib.contextmanager
def _sleeper_run(tmp_path, tmp_run_dir, sigint):
    """`run sleeper.py` in its own process group (as a shell gives a job), started with the
    SIGINT disposition `sigint`; yields the command once its ranks are ready, and ends it
    and its output files whatever the test did."""
    out, err = open(tmp_path / "out.txt", "w"), open(tmp_path / "err.txt", "w")
    p = subprocess.Popen(cli("run", SCRIPTS / "sleeper.py", "--run-dir", tmp_run_dir), cwd=tmp_path,
                         env=child_env(), stdout=out, stderr=err, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))
    try:
        assert wait_until(ranks_ready(tmp_run_dir), 60), "ranks never became ready"
        yield p
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        out.close()
        err.close()


@pytest.mark.timeout(90)
def test_started_with_sigint_ignored_it_stays_ignored_and_sigterm_ends_the_run(tmp_path, tmp_run_dir):
    """The documented choice (`run --help`, README): a background job of a non-interactive
    shell or a nohup'ed command starts with SIGINT ignored, and the run leaves it so; SIGTERM
    ends it as Ctrl-C would."""
    with _sleeper_run(tmp_path, tmp_run_dir, sigint=signal.SIG_IGN) as p:
        ignored = _ignored_signals(p.pid)
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=30)
    assert signal.SIGINT in ignored
    assert rc == 130, (tmp_path / "err.txt").read_text()
    assert json.loads((tmp_run_dir / "result.json").read_text())["status"] == "interrupted"


@pytest.mark.timeout(90)
def test_ctrl_c_ends_every_process_and_exits_130(tmp_path, tmp_run_dir):
    # A terminal's foreground job has SIGINT at its default; pytest started as a background
    # job of a non-interactive shell (or under nohup) has it ignored, and the child would
    # inherit that, so the disposition the test means is set here.
    with _sleeper_run(tmp_path, tmp_run_dir, sigint=signal.SIG_DFL) as p:
        pids = {q.pid for q in procs.run_processes(tmp_run_dir)} | {q.pid for q in procs.tree(p.pid)}
        pids.discard(p.pid)
        assert len(pids) >= 3  # agent + 2 ranks
        t0 = time.monotonic()
        os.killpg(p.pid, signal.SIGINT)
        rc = p.wait(timeout=30)
        exited = time.monotonic() - t0
        gone = wait_until(lambda: not [q for q in pids if psutil.pid_exists(q)
                                       and psutil.Process(q).status() != psutil.STATUS_ZOMBIE], 1)
    print(f"Ctrl-C: command exited after {exited:.2f} s")
    assert rc == 130, (tmp_path / "err.txt").read_text()
    assert exited < 10
    assert gone, "processes of the run outlived the command"
    assert json.loads((tmp_run_dir / "result.json").read_text())["status"] == "interrupted"
    stderr = (tmp_path / "err.txt").read_text()
    assert "interrupted" in stderr and "Traceback" not in stderr


# -- failures --------------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("args", [[], ["--record"]], ids=["plain-script", "with-record"])
def test_failing_rank_is_named_with_its_traceback(tmp_path, tmp_run_dir, args):
    t0 = time.monotonic()
    out = run_cli(["run", SCRIPTS / "raises.py", "--run-dir", tmp_run_dir, "--", *args], cwd=tmp_path,
                  timeout=90)
    elapsed = time.monotonic() - t0
    print(f"failing rank {args}: command exited after {elapsed:.1f} s")
    assert out.returncode == 1, out.stderr
    assert elapsed < 60
    result = json.loads((tmp_run_dir / "result.json").read_text())
    assert result["status"] == "failed" and result["returncode"] != 0
    failure = result["failure"]
    assert failure["rank"] == 1 and failure["exitcode"] == 1
    assert failure["message"] == "ValueError: boom from rank 1"
    assert "in explode" in failure["traceback"] and "ValueError: boom from rank 1" in failure["traceback"]
    assert "ddp_lesson/rank/guard.py" not in failure["traceback"]  # the script's frames, not ours
    # the printed report names the root cause, not the rank torn down after it
    assert "Rank 1 failed first" in out.stderr
    assert "ValueError: boom from rank 1" in out.stderr and "in explode" in out.stderr
    assert "Rank 0 failed first" not in out.stderr
    assert out.stderr.count("in explode") == 1, out.stderr  # the traceback once, not again in the summary
    assert "rank 0 should not get here" not in out.stdout


@pytest.mark.timeout(400)
def test_rank_that_never_joins_the_collective_times_out(tmp_path):
    # The timeout counts from the start, and the ranks must reach the hang before it ends for
    # the message to name the collective: on a busy machine starting them (import torch) took
    # over 8 s, and at load ~17 over 20 s, so the first try allows 30 s, and if the ranks still
    # were not in the group it runs again with twice the timeout (the bounds scale with it).
    # Each try is a launch (~10 CPU-s); the waiting is idle.
    for timeout in (30, 60):
        run_dir = tmp_path / f"run{timeout}"
        t0 = time.monotonic()
        out = run_cli(["run", SCRIPTS / "hang.py", "--timeout", timeout, "--run-dir", run_dir],
                      cwd=tmp_path, timeout=timeout + 80)
        elapsed = time.monotonic() - t0
        print(f"hang with --timeout {timeout}: command exited after {elapsed:.1f} s")
        # tests/scripts/hang.py prints "ready rank N" once in the group, then rank 0 waits in
        # the all_reduce; a log is absent if its rank never started
        logs = [run_dir / "logs" / f"rank{r}.stdout.log" for r in (0, 1)]
        if all(log.exists() and "ready rank" in log.read_text() for log in logs):
            break
    assert out.returncode == 1, out.stderr
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "timeout"
    assert timeout <= result["duration_s"] < timeout + 15  # stopped at the timeout, then a short teardown
    assert elapsed < timeout + 25
    assert "run timeout" in out.stderr and f"{timeout} s timeout" in out.stderr
    assert "collective" in out.stderr and "Traceback" not in out.stderr


# -- cleanup ---------------------------------------------------------------------------------

def _pid_namespaces_work():
    if not shutil.which("unshare"):
        return False
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                              capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.timeout(120)
def test_cleanup_ends_leftover_runs_and_nothing_else(tmp_path, tmp_run_dir):
    """`cleanup` ends every ddp_lesson run it can see, so it runs in a private PID
    namespace: it must not end the runs of other people on this machine."""
    if not _pid_namespaces_work():
        pytest.skip("needs `unshare --pid` (root or user namespaces) to isolate cleanup")
    out_file = tmp_path / "torchrun.out"
    p = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable,
                        str(SCRIPTS / "mini_init.py"), sys.executable, str(SCRIPTS / "cleanup_scenario.py"),
                        str(tmp_run_dir), str(SCRIPTS / "sleeper.py"), str(out_file)],
                       env=child_env(), capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"cleanup: {len(report['leftover'])} processes gone after {report['gone_after_s']} s")
    assert len(report["leftover"]) >= 3, (report, out_file.read_text())  # torchrun + 2 ranks
    dry = report["dry_run"]
    assert dry["rc"] == 0
    assert sorted(dry["alive_after"]) == sorted(report["leftover"])  # --dry-run ends nothing
    assert all(f"pid {pid} " in dry["stdout"] for pid in report["leftover"])
    clean = report["cleanup"]
    assert clean["rc"] == 0, clean
    ended = [line for line in clean["stdout"].splitlines() if re.search(r"\bpid \d+\b", line)]
    assert len(ended) == len(report["leftover"]), clean["stdout"]
    assert all(str(tmp_run_dir) in line for line in ended)
    # gone by the time cleanup returned, or within seconds of it (its own start, which a busy
    # machine slows, is not what is measured)
    assert report["alive_after"] == [] and report["gone_after_s"] - clean["seconds"] < 10, report
    assert report["bystander_alive"]
    assert report["impostor_alive"]  # DDP_LESSON_RUN_DIR without the run's token is not ours
    assert json.loads((tmp_run_dir / "result.json").read_text())["status"] == "interrupted"


# -- demo ------------------------------------------------------------------------------------

@pytest.mark.timeout(180)
def test_demo_learns(tmp_path, tmp_run_dir):
    t0 = time.monotonic()
    out = run_cli(["demo", "--epochs", "2", "--run-dir", tmp_run_dir], cwd=tmp_path, timeout=150)
    print(f"demo --epochs 2: {time.monotonic() - t0:.1f} s")
    assert out.returncode == 0, out.stderr
    m = re.search(r"summary: test accuracy ([\d.]+)%", out.stdout)
    assert m, out.stdout[-2000:]
    assert float(m.group(1)) > 50  # chance is 10%
    assert json.loads((tmp_run_dir / "result.json").read_text())["status"] == "ok"
