"""Run directories read back, the script-side metrics logger, and failure diagnosis.

- `metrics.log` appends {rank, step, time, **metrics} lines to metrics/rank<R>.jsonl,
  turning tensors into floats, and does nothing outside the launcher;
- `MetricsTail` returns only complete new lines (a row being written comes next time),
  in time order over all ranks; `LogTail` returns only new text; `log_tail` is a rank's last
  lines by run directory, rank and stream; `tail_text` keeps the last state of a
  carriage-return progress bar;
- `runs.load` / `RunRecord.series` / `summary` / `compare` read a run back;
- `failures.root_cause` picks the first failing rank, not the ranks torn down after it,
  both when ranks raised (error files) and when one was killed by a signal (torchrun's
  summary), and `describe` explains -9 as memory;
- a script using ddp_lesson.rank.metrics also runs under plain
  `python -m torch.distributed.run` without the launcher, writing nothing.
"""
import json
import os
import re
import time

import pytest
import torch

from conftest import SCRIPTS, plain_torchrun
from ddp_lesson.launcher import failures, runs
from ddp_lesson.rank import metrics, rundir


@pytest.fixture
def fresh_metrics(monkeypatch, tmp_path):
    """metrics.log as rank 1 of a run in tmp_path/run, with the module's file closed."""
    metrics.close()
    run_dir = tmp_path / "run"
    monkeypatch.setenv("DDP_LESSON_RUN_DIR", str(run_dir))
    monkeypatch.setenv("RANK", "1")
    yield run_dir
    metrics.close()


def test_metrics_log_writes_one_json_line_per_call(fresh_metrics):
    t0 = time.time()
    metrics.log(0, loss=torch.tensor(2.5), test_accuracy=0.25)
    metrics.log(torch.tensor(1), loss=1.5, note="text")
    lines = (fresh_metrics / "metrics" / "rank1.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["rank"] == 1 and rows[0]["loss"] == 2.5 and isinstance(rows[0]["loss"], float)
    assert rows[1]["note"] == "text"
    assert all(t0 - 1 <= r["time"] <= time.time() for r in rows)


def test_metrics_log_outside_the_launcher_does_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(metrics, "_file", None)
    monkeypatch.delenv("DDP_LESSON_RUN_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    metrics.log(0, loss=1.0)
    assert list(tmp_path.iterdir()) == []


def test_metrics_tail_reads_only_complete_new_rows(tmp_path):
    folder = tmp_path / "metrics"
    folder.mkdir()
    tail = runs.MetricsTail(tmp_path)
    assert tail.read() == []
    r0, r1 = folder / "rank0.jsonl", folder / "rank1.jsonl"
    r0.write_text(json.dumps({"rank": 0, "step": 0, "time": 3.0}) + "\n")
    r1.write_text(json.dumps({"rank": 1, "step": 0, "time": 1.0}) + "\n" + '{"rank": 1, "st')
    assert [(r["rank"], r["time"]) for r in tail.read()] == [(1, 1.0), (0, 3.0)]  # time order
    assert tail.read() == []
    with open(r1, "a") as f:  # the half-written row is completed
        f.write('ep": 1, "time": 2.0}\nnot json\n')
    assert tail.read() == [{"rank": 1, "step": 1, "time": 2.0}]  # broken lines are skipped
    (folder / "notes.txt").write_text("ignored\n")
    assert tail.read() == []


def test_a_run_with_more_rows_than_one_read_comes_back_whole(tmp_path):
    """Log reads stop at MAX_READ per call; metric rows are read on until caught up, so a
    long run's last rows (its final test accuracy) are not lost."""
    folder = tmp_path / "metrics"
    folder.mkdir()
    n = 3 * runs.MetricsTail.MAX_READ // 60 + 1   # each row is about 60-70 bytes
    with open(folder / "rank0.jsonl", "w") as f:
        for s in range(n):
            f.write(json.dumps({"rank": 0, "step": s, "time": float(s), "loss": 1.0 / (s + 1)}) + "\n")
        f.write(json.dumps({"rank": 0, "step": n, "time": float(n), "test_accuracy": 0.9}) + "\n")
    assert (folder / "rank0.jsonl").stat().st_size > 3 * runs.MetricsTail.MAX_READ
    rows = runs.load_metrics(tmp_path)           # what runs.load(run_dir).rows holds
    assert len(rows) == n + 1 and rows[-1]["test_accuracy"] == 0.9


def test_log_tail_and_tail_text(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0.stdout.log").write_text("a\n")
    (logs / "rank1.stderr.log").write_text("err\n")
    (logs / "agent.log").write_text("not a rank\n")
    tail = runs.LogTail(tmp_path)
    assert sorted(tail.read()) == [(0, "stdout", "a\n"), (1, "stderr", "err\n")]
    with open(logs / "rank0.stdout.log", "a") as f:
        f.write("b\n")
    assert tail.read() == [(0, "stdout", "b\n")]
    assert runs.LogTail(tmp_path, ranks=[1], streams=("stdout",)).read() == []
    (logs / "bar.log").write_text("epoch 1 [#...]\repoch 1 [##..]\repoch 1 [####]\nline 2\nline 3\n")
    assert runs.tail_text(logs / "bar.log", 2) == "line 2\nline 3"
    assert runs.tail_text(logs / "bar.log", 3).splitlines()[0] == "epoch 1 [####]"
    assert runs.tail_text(logs / "missing.log") == ""
    # a rank's tail by run directory, rank and stream (rundir's names)
    assert runs.log_tail(tmp_path) == "a\nb" and runs.log_tail(tmp_path, lines=1) == "b"
    assert runs.log_tail(tmp_path, rank=1, stream="stderr") == "err"
    assert runs.log_tail(tmp_path, rank=1) == "" and runs.log_tail(tmp_path, rank=2) == ""


def make_run(path, rows, result=None):
    (path / "metrics").mkdir(parents=True)
    rundir.write_json(path / "config.json", {"label": path.name, "nproc": 2, "backend": "gloo"})
    for rank in (0, 1):
        with open(path / "metrics" / f"rank{rank}.jsonl", "w") as f:
            for row in rows:
                if row["rank"] == rank:
                    f.write(json.dumps(row) + "\n")
    if result:
        rundir.write_json(path / "result.json", result)
    return path


def test_run_record_series_summary_and_compare(tmp_path):
    rows = [{"rank": r, "step": s, "time": s + r / 10, "loss": 1.0 / (s + 1) + r} for s in range(3)
            for r in (0, 1)]
    rows.append({"rank": 0, "step": 2, "time": 9, "test_accuracy": 0.9, "samples_per_s": 100.0})
    a = make_run(tmp_path / "a", rows, {"status": "ok", "returncode": 0, "duration_s": 4.2})
    b = make_run(tmp_path / "b", rows[:2])
    rec = runs.load(a)
    assert rec.status == "ok" and rec.ranks() == [0, 1] and len(rec.rows) == 7
    assert rec.series("loss", rank=1) == [(0, 2.0), (1, 1.5), (2, 1 / 3 + 1)]
    assert rec.series("loss")[0] == (0, 1.5)  # mean over ranks per step
    assert rec.series("loss", reduce="sum")[0] == (0, 3.0)
    s = rec.summary()
    assert s["final_accuracy"] == 0.9 and s["samples_per_s"] == 100.0 and s["duration_s"] == 4.2
    assert [c["status"] for c in runs.compare([a, b])] == ["ok", "running"]
    with pytest.raises(FileNotFoundError):
        runs.load(tmp_path)


def test_write_json_is_atomic(tmp_path):
    rundir.write_json(tmp_path / "x.json", {"a": 1})
    assert rundir.read_json(tmp_path / "x.json") == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]  # no temporary left behind
    assert rundir.read_json(tmp_path / "missing.json", "dflt") == "dflt"


# -- failure diagnosis ----------------------------------------------------------------------

AGENT_LOG = """...
Root Cause (first observed failure):
[0]:
  time      : 2026-01-01_00:00:00
  host      : localhost
  rank      : {rank} (local_rank: {rank})
  exitcode  : {code} (pid: 1234)
  error_file: <N/A>
"""


def error_file(logs, rank, t, message, restart=0):
    rundir.write_json(logs / f"rank{rank}.error.json", {"rank": rank, "message": message, "time": t,
                                                      "traceback": f"Traceback ...\n{message}\n",
                                                      "restart": restart})


def test_root_cause_is_the_first_rank_that_raised(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    error_file(logs, 0, 10.5, "RuntimeError: Connection closed by peer")
    error_file(logs, 1, 10.0, "ValueError: bad shape")
    (logs / "agent.log").write_text(AGENT_LOG.format(rank=0, code=1))  # torchrun's guess differs
    f = failures.root_cause(tmp_path)
    assert f["rank"] == 1 and f["message"] == "ValueError: bad shape" and f["exitcode"] == 1
    assert "bad shape" in f["traceback"]
    assert failures.describe(f).startswith("Rank 1 failed first (exited with status 1): ValueError")


def test_root_cause_prefers_the_latest_restart(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    error_file(logs, 1, 5.0, "ValueError: first attempt", restart=0)
    error_file(logs, 0, 20.0, "OSError: second attempt", restart=1)
    assert failures.root_cause(tmp_path)["rank"] == 0


def test_rank_killed_by_signal_is_the_root_cause_not_its_peers(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    error_file(logs, 0, 10.5, "RuntimeError: Connection closed by peer")  # a consequence
    rundir.write_json(logs / "rank0.error.json", dict(rundir.read_json(logs / "rank0.error.json"), pid=100))
    rundir.write_json(logs / "agent.failures.json", {"failures": [  # torchrun's structured record
        {"rank": 0, "pid": 100, "exitcode": 1, "timestamp": 10},
        {"rank": 1, "pid": 101, "exitcode": -9, "timestamp": 11}]})
    (logs / "rank1.stderr.log").write_text("last words\n")
    f = failures.root_cause(tmp_path)
    assert (f["rank"], f["exitcode"]) == (1, -9)
    assert "memory" in failures.describe(f) and f["traceback"] == "last words"


def test_explanations():
    assert "memory" in failures.explain(-9)
    assert "SIGTERM" in failures.explain(-15)
    assert failures.explain(-7) == "killed by signal 7"
    assert failures.explain(3) == "exited with status 3"
    assert "agent.log" in failures.describe(None)
    assert failures.root_cause("/nonexistent/run") is None


# -- scripts run without the launcher --------------------------------------------------------

@pytest.mark.timeout(120)
def test_script_runs_under_plain_torchrun(tmp_path):
    """ddp_lesson.rank.metrics is optional plumbing: a plain torchrun run works and
    writes no run directory."""
    p = plain_torchrun(SCRIPTS / "contract.py", "--steps", "2", cwd=tmp_path, timeout=100)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "world size 2" in p.stdout and p.stdout.count("world size") == 1  # rank 0 only
    # two processes share one pipe: a rank's line can land in the middle of another's
    envs = [json.loads(m) for m in re.findall(r"env (\{[^{}]*\})", p.stdout)]
    assert sorted(e["RANK"] for e in envs) == ["0", "1"]
    assert all(e["DDP_LESSON_RUN_DIR"] is None for e in envs)
    assert list(tmp_path.iterdir()) == []  # no metrics, no run directory


def test_killed_rank_wins_even_when_torchrun_names_a_torn_down_peer(tmp_path):
    """torchrun's 'first observed failure' compares whole seconds: seen here, it named
    rank 0 (torn down with -15 after its all_reduce failed) instead of rank 1 (SIGKILL).
    Its structured record has both in the same second; the SIGKILLed rank is the cause."""
    logs = tmp_path / "logs"
    logs.mkdir()
    error_file(logs, 0, 10.5, "RuntimeError: Connection closed by peer")
    rundir.write_json(logs / "rank0.error.json", dict(rundir.read_json(logs / "rank0.error.json"), pid=100))
    rundir.write_json(logs / "agent.failures.json", {"failures": [
        {"rank": 0, "pid": 100, "exitcode": -15, "timestamp": 10},
        {"rank": 1, "pid": 101, "exitcode": -9, "timestamp": 10}]})
    f = failures.root_cause(tmp_path)
    assert (f["rank"], f["exitcode"]) == (1, -9), f


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="Linux /proc only")
def test_memory_field_is_this_process_rss_also_after_a_fork():
    """StepTimer's mem_mb keeps /proc/self/statm open; a forked child must read its own."""
    big = bytearray(200 * 2**20)
    big[::4096] = b"\x01" * len(big[::4096])   # touch every page: 200 MB more resident here
    parent = metrics.rss_mb()
    pid = os.fork()
    if pid == 0:
        del big                                 # the child lets go of them
        with open("/proc/self/statm") as f:
            own = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        os._exit(0 if abs(metrics.rss_mb() - own) < 20 and parent - own > 100 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_listening_ports_are_psutils_without_psutil():
    """metrics.listening_ports (rank side, standard library) finds the ports a process listens
    on, IPv4 and IPv6, and not a connected socket's port: what psutil says."""
    import socket

    import psutil

    from ddp_lesson.rank import metrics
    held = [socket.socket(), socket.socket(socket.AF_INET6)]
    try:
        held[0].bind(("127.0.0.1", 0))
        held[1].bind(("::1", 0))
        for s in held:
            s.listen()
        client = socket.create_connection(held[0].getsockname())
        held.append(client)
        ours = metrics.listening_ports(os.getpid())
        theirs = sorted({c.laddr.port for c in psutil.Process().net_connections("tcp")
                         if c.status == psutil.CONN_LISTEN})
        assert ours == theirs
        assert {held[0].getsockname()[1], held[1].getsockname()[1]} <= set(ours)
        assert client.getsockname()[1] not in ours
    finally:
        for s in held:
            s.close()
