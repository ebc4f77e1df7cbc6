"""Reliability of the launcher (`ddp_lesson.launcher.launch`) with real torchrun process trees.

Every test starts a real `torchrun` with 2 gloo ranks on CPU and checks what a learner
relies on:

- the run directory contract: config.json, script.py, logs/, metrics/rank<R>.jsonl,
  result.json, and DDP_LESSON_RUN_DIR (absolute) in every rank's environment;
- metric rows can be read (`runs.MetricsTail(run.run_dir).read()`) while the run is still going;
- a run works although port 29500 is taken and MASTER_PORT=29500 is in the environment;
- `Run.stop()` and an interrupt during `Run.wait()` (what a notebook's stop button does)
  end every process of the run within 10 s, with status `interrupted`: stop() on ranks that
  ignore SIGTERM (so it must escalate to SIGKILL), the interrupt on ranks that end on
  SIGTERM (wait() stops the run with stop(), so one launch each covers both kinds of rank);
- when the launching process is SIGKILLed (a Jupyter kernel restart), the agent and every
  rank end by themselves within 10 s;
- a rank killed by SIGKILL is reported as such, with the likely cause (memory);
- with `max_restarts=1` a run whose rank dies once resumes from its checkpoint and
  completes;
- a launch is a spec.Spec: bad input in any of its fields is one sentence before anything
  starts, whether start()'s keywords or a Spec carry it (a private file's name included);
  config.json records a Spec whole (Spec.of_run gives it back from the run directory, pinned
  to the devices the run had);
- a PYTHONPATH in a launch's env keeps this package first.

Every test runs twice: warm (the default: agent and ranks forked from a warm process) and
cold (DDP_LESSON_COLD=1: new interpreters, as a CLI torchrun), and checks that its launches
went that way. The autouse fixture in conftest.py also fails any test that leaves a process
of its runs behind. Failures printed by the command line (`run` exit codes) are in test_cli.py.
"""
import json
import os
from dataclasses import replace
from pathlib import Path
import signal
import socket
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import pytest

from conftest import REPO, SCRIPTS, child_env, processes_under, wait_until
from ddp_lesson.launcher import devices, launch, runs, spec
from ddp_lesson.rank import procs, rundir

pytestmark = pytest.mark.usefixtures("launch_mode", "launches_went_that_way")
from ddp_lesson.rank.bundled import script

RESUME = script("resume.py")
FIRST_RUN = script("first_run.py")


def ranks_ready(run_dir, nproc=2, word="ready"):
    """True once every rank's stdout log contains `word`."""
    def check():
        for r in range(nproc):
            log = run_dir / "logs" / f"rank{r}.stdout.log"
            if not log.exists() or word not in log.read_text(errors="replace"):
                return False
        return True
    return check


def all_gone(pids):
    return not [p for p in pids if psutil.pid_exists(p) and _not_zombie(p)]


def _not_zombie(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def run_pids(run):
    """Everything of a run alive now: the agent's tree and the processes carrying its run dir."""
    return set(run.pids()) | {p.pid for p in procs.run_processes(run.run_dir)}


def hold_port(port=29500):
    """Bind (and listen on) 0.0.0.0:port and 127.0.0.1:port where possible."""
    held = []
    for host in ("0.0.0.0", "127.0.0.1"):
        s = socket.socket()
        try:
            s.bind((host, port))
            s.listen()
            held.append(s)
        except OSError:
            s.close()
    return held


# -- one successful run serves the contract checks ------------------------------------------

@pytest.fixture(scope="module")
def contract_run(tmp_path_factory, launch_mode):
    base = tmp_path_factory.mktemp("contract")
    gate = base / "gate"
    held = hold_port(29500)  # none held: something else has it already, just as good
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MASTER_PORT", "29500")
        # a kernel started under torchrun or Slurm: none of it may reach the run (issue 10)
        for k, v in {"RANK": "5", "LOCAL_RANK": "3", "WORLD_SIZE": "7", "MASTER_ADDR": "203.0.113.1",
                     "TORCHELASTIC_RUN_ID": "other", "TORCHELASTIC_RESTART_COUNT": "4"}.items():
            mp.setenv(k, v)
        run = launch.start(SCRIPTS / "contract.py", nproc=2, run_dir=base / "run",
                           args=["--gate", gate, "--steps", "3"])
        try:
            # while the ranks wait at the gate, the first 3 steps of each rank are readable
            tail, live = runs.MetricsTail(run.run_dir), []
            end = time.monotonic() + 60
            while len(live) < 6 and time.monotonic() < end and not run.done():
                live += tail.read()
                time.sleep(0.1)
            status_while_reading = run.status
            gate.touch()
            result = run.wait(timeout=60)
            late = tail.read()
        finally:
            run.stop()
            for s in held:
                s.close()
    return {"run": run, "live": live, "late": late, "result": result,
            "status_while_reading": status_while_reading, "ports_held": len(held)}


@pytest.mark.timeout(120)
def test_run_ok_although_port_29500_is_taken(contract_run):
    run = contract_run["run"]
    assert contract_run["result"] is not None, "the run did not finish within 60 s"
    assert run.status == "ok", run.result
    assert run.result["returncode"] == 0
    env = json.loads(runs.log_tail(run.run_dir, 0, lines=50).split("env ", 1)[1].splitlines()[0])
    assert env["MASTER_PORT"] != "29500"


@pytest.mark.timeout(120)
def test_metrics_readable_while_the_run_goes(contract_run):
    live = contract_run["live"]
    assert contract_run["status_while_reading"] == "running"
    assert len(live) == 6, live
    assert sorted((r["rank"], r["step"]) for r in live) == [(r, s) for r in (0, 1) for s in range(3)]
    assert [r["time"] for r in live] == sorted(r["time"] for r in live)
    # the rows written after the gate come with the next call, and nothing twice
    late = contract_run["late"]
    assert sorted((r["rank"], r["step"]) for r in late) == [(0, 3), (1, 3)]
    assert runs.load(contract_run["run"].run_dir).rows == live + late   # every row on disk, once


@pytest.mark.timeout(120)
def test_run_directory_contract(contract_run, launch_mode):
    run = contract_run["run"]
    d = run.run_dir
    assert d.is_absolute()
    config = json.loads((d / "config.json").read_text())
    for key in ("script", "nproc", "devices", "backend", "args", "versions", "start_time"):
        assert key in config, key
    assert config["script"] == str(SCRIPTS / "contract.py")
    assert config["nproc"] == 2 and config["backend"] == "gloo" and config["devices"] == []
    assert config["launch"]["mode"] == launch_mode
    assert config["args"][0] == "--gate" and config["args"][2:] == ["--steps", "3"]
    assert config["versions"]["torch"] and config["versions"]["python"]
    assert (d / "script.py").read_bytes() == (SCRIPTS / "contract.py").read_bytes()
    for r in (0, 1):
        for stream in ("stdout", "stderr"):
            assert (d / "logs" / f"rank{r}.{stream}.log").is_file()
        out = (d / "logs" / f"rank{r}.stdout.log").read_text()
        env = json.loads(out.split("env ", 1)[1].splitlines()[0])
        assert env["RANK"] == str(r)
        assert env["DDP_LESSON_RUN_DIR"] == str(d)  # absolute, in every rank
        assert env["WORLD_SIZE"] == "2"
    assert "world size 2" in (d / "logs" / "rank0.stdout.log").read_text()
    assert "world size" not in (d / "logs" / "rank1.stdout.log").read_text()  # print0
    start = config["start_unix"]
    for r in (0, 1):
        rows = [json.loads(line) for line in (d / "metrics" / f"rank{r}.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows] == [0, 1, 2, 3]
        for row in rows:
            assert row["rank"] == r
            assert start - 1 < row["time"] < time.time()
            assert isinstance(row["loss"], float) and "test_accuracy" in row
    result = json.loads((d / "result.json").read_text())
    assert result["status"] == "ok" and result["returncode"] == 0
    assert 0 < result["duration_s"] < 120
    assert "failure" not in result
    record = runs.load(d)
    assert record.status == "ok" and record.ranks() == [0, 1]
    assert record.series("test_accuracy", rank=1)[-1] == (3, 1.0)


# -- the spec: what a launch is (issue 33) ----------------------------------------------------

def test_the_run_directory_gives_the_spec_back(contract_run):
    """The run was launch.start(contract.py, nproc=2, args=[...]): its run directory holds that
    launch whole (the script that ran as script.py), pinned to the devices it got."""
    run = contract_run["run"]
    config = json.loads((run.run_dir / "config.json").read_text())
    asked = launch.Spec(run.run_dir / "script.py", devices.plan(nproc=2).request(), args=run.config["args"],
                        label="contract")
    assert launch.Spec.of_run(run.run_dir) == asked
    assert config["script"] == str(SCRIPTS / "contract.py")
    assert spec.gpus(config) == [] and config["device_env"]["CUDA_VISIBLE_DEVICES"] == ""
    assert runs.load(run.run_dir).device_env == config["device_env"] and "OMP_NUM_THREADS" in config["device_env"]


def test_every_field_of_a_spec_round_trips_through_config_json(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    full = launch.Spec(script, devices.Request(nproc=3, cpu=True), args=["--epochs", 2], max_restarts=1,
                       timeout=30, env={"A": 1, "B": "x"}, label="full",
                       nodes=spec.Nodes(2, 1, "10.0.0.1:29400", "job7"), private_files={"key": b"k"}, cold=True)
    assert full.args == ("--epochs", "2") and full.env == (("A", "1"), ("B", "x")) and full.timeout == 30.0
    plan = full.devices.plan()
    config = json.loads(json.dumps(spec.fields(full, plan)))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "script.py").write_text("print('the copy that ran')\n")
    (run_dir / "config.json").write_text(json.dumps(config))
    back = launch.Spec.of_run(run_dir)
    assert back == replace(full, script=run_dir / "script.py", private_files={})   # secrets never go into config.json
    assert "key" not in json.dumps(config) and "b'k'" not in repr(full)
    assert config["devices"] == [] and config["world_size"] == 6 and config["rdzv_id"] == "job7"
    assert spec.device_env(config) == plan.env and "OMP_NUM_THREADS" in plan.env
    assert runs.load(run_dir).device_env == plan.env


def test_a_spec_holds_its_script_absolute(tmp_path, monkeypatch):
    """Built in one working folder, launched from another: the same file."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    s = launch.Spec("train.py")
    monkeypatch.chdir("/")
    assert s.script == tmp_path.resolve() / "train.py" and s.script.is_file() and s.label == "train"


BAD_SPECS = {
    "missing script": ({"script": "no_such.py"}, "The script no_such.py does not exist."),
    "script is a folder": ({"script": "."}, "The script . is not a file."),
    "nproc 0": ({"nproc": 0}, "--nproc must be at least 1, got 0."),
    "gpus not numbers": ({"gpus": "a,b"}, "--gpus takes GPU numbers separated by commas, like 0,1; got 'a,b'."),
    "no gpu ticked": ({"gpus": []}, "No GPU was selected; pick at least one, or use CPU processes."),
    "args one string": ({"args": "--epochs 1"}, "The script's args must be a list of words, "
                                                 "like [\"--epochs\", \"1\"]; got '--epochs 1'."),
    "max_restarts -1": ({"max_restarts": -1}, "--max-restarts must be at least 0, got -1."),
    "timeout 0": ({"timeout": 0}, "--timeout must be at least 0.001, got 0."),
    "env a list": ({"env": ["A=1"]}, "The env must map names to values, like {\"OMP_NUM_THREADS\": 1}; "
                                     "got ['A=1']."),
    "nnodes 0": ({"nnodes": 0}, "--nnodes must be at least 1, got 0."),
    "node_rank too big": ({"nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"},
                          "--node-rank must be below --nnodes (2), got 2."),
    "nodes without endpoint": ({"nnodes": 2}, "A run over several nodes needs --rdzv-endpoint HOST:PORT "
                                              "(node 0's address)."),
    "private file not bytes": ({"private_files": {"key": "text"}},
                               "The private_files must map file names to bytes; got {'key': 'text'}."),
}
# a private file that would clobber the contract's files or land outside the run directory
FREE = ("A private file needs a bare file name that the run directory leaves free "
        "(not config.json, script.py, result.json, logs, metrics, model.pt); got ")
for bad in ("script.py", "config.json", "logs", "logs/x", "../x", "/tmp/x", ".", ""):
    BAD_SPECS[f"private file {bad!r}"] = ({"private_files": {bad: b"k"}}, f"{FREE}{bad!r}.")


@pytest.mark.parametrize("case", list(BAD_SPECS))
def test_bad_input_in_any_field_is_one_sentence_before_anything_starts(case, tmp_path, monkeypatch):
    kwargs, sentence = BAD_SPECS[case]
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    kwargs = {"script": script, **kwargs}
    # nothing may start: not the warm process, not a run directory
    monkeypatch.setattr(launch, "_warm_server", lambda *a: pytest.fail("a launch began"))
    with pytest.raises(launch.BadInput) as err:
        launch.start(**kwargs, run_dir=tmp_path / "run")
    assert str(err.value) == sentence and not (tmp_path / "run").exists()
    # the keywords and a Spec built by hand meet the same check, in the one place
    ask = {k: kwargs.pop(k) for k in ("nproc", "gpus", "cpu") if k in kwargs}
    nodes = {k: kwargs.pop(k) for k in ("nnodes", "node_rank", "rdzv_endpoint") if k in kwargs}
    with pytest.raises(launch.BadInput) as err:
        launch.Spec(devices=devices.Request(**ask), nodes=spec.Nodes(*nodes.values()), **kwargs)
    assert str(err.value) == sentence


# -- stopping --------------------------------------------------------------------------------

@pytest.mark.timeout(90)
def test_stop_ends_every_process_within_10_s(tmp_run_dir):
    """Ranks that ignore SIGTERM: stop() must escalate to SIGKILL. Ranks that end on SIGTERM
    are stopped the same way by the interrupt test below (wait() calls stop())."""
    args = ["--ignore-term"]
    run = launch.start(SCRIPTS / "sleeper.py", nproc=2, run_dir=tmp_run_dir, args=args)
    try:
        assert wait_until(ranks_ready(tmp_run_dir), 60), "ranks never became ready"
        pids = run_pids(run)
        assert len(pids) >= 3  # agent + 2 ranks
        t0 = time.monotonic()
        result = run.stop()
        gone = wait_until(lambda: all_gone(pids), 10 - (time.monotonic() - t0))
        elapsed = time.monotonic() - t0
    finally:
        run.stop()
    print(f"stop() {args}: every process gone after {elapsed:.2f} s")
    assert gone, f"still alive 10 s after stop(): {[p for p in pids if psutil.pid_exists(p)]}"
    assert result["status"] == "interrupted" and run.status == "interrupted"
    assert json.loads((tmp_run_dir / "result.json").read_text())["status"] == "interrupted"
    assert not procs.run_processes(tmp_run_dir)


@pytest.mark.timeout(90)
def test_interrupt_during_wait_stops_the_run(tmp_run_dir, kernel_sigint):
    """A notebook's Interrupt button raises KeyboardInterrupt in the kernel's main thread."""
    run = launch.start(SCRIPTS / "sleeper.py", nproc=2, run_dir=tmp_run_dir)
    seen = {}

    def interrupter():
        if wait_until(ranks_ready(tmp_run_dir), 60):
            seen["pids"] = run_pids(run)
            seen["t0"] = time.monotonic()
            os.kill(os.getpid(), signal.SIGINT)

    t = threading.Thread(target=interrupter, daemon=True)
    # kernel_sigint: a kernel's Interrupt raises KeyboardInterrupt whatever pytest inherited
    # (a background job of a non-interactive shell starts with SIGINT ignored)
    t.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run.wait(timeout=70)
        elapsed = time.monotonic() - seen["t0"]
        gone = wait_until(lambda: all_gone(seen["pids"]), max(0.0, 10 - elapsed))
        elapsed = time.monotonic() - seen["t0"]
    finally:
        run.stop()
    print(f"KeyboardInterrupt in wait(): every process gone after {elapsed:.2f} s")
    assert gone and elapsed < 10
    assert run.status == "interrupted" and run.stop()["status"] == "interrupted"
    assert json.loads((tmp_run_dir / "result.json").read_text())["status"] == "interrupted"
    assert not procs.run_processes(tmp_run_dir)


LAUNCHER = """
import sys, time
from ddp_lesson.launcher import launch
run = launch.start(sys.argv[1], nproc=2, run_dir=sys.argv[2])
print(run.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(90)
def test_killed_launcher_leaves_nothing_behind(tmp_run_dir, tmp_path):
    """A Jupyter kernel restart SIGKILLs the kernel; nothing forwards it to torchrun."""
    out = open(tmp_path / "launcher.out", "w+")
    # the launcher's temporary folder, where its warm processes' folders go: short, since a Unix
    # socket's path holds at most 107 bytes
    tmp = Path(tempfile.mkdtemp(prefix="kl-"))
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(SCRIPTS / "sleeper.py"),
                                 str(tmp_run_dir)], env=dict(child_env(), TMPDIR=str(tmp)), stdout=out,
                                stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        assert wait_until(ranks_ready(tmp_run_dir), 60), "ranks never became ready"
        agent = int((tmp_path / "launcher.out").read_text().split()[0])
        pids = {p.pid for p in procs.tree(agent)} | {p.pid for p in procs.run_processes(tmp_run_dir)}
        assert agent in pids and len(pids) >= 3
        t0 = time.monotonic()
        launcher.kill()
        launcher.wait()
        gone = wait_until(lambda: all_gone(pids) and not procs.run_processes(tmp_run_dir), 10)
        elapsed = time.monotonic() - t0
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for p in processes_under(tmp_run_dir):
            p.kill()
        out.close()
    print(f"launcher SIGKILLed: agent and ranks gone after {elapsed:.2f} s")
    assert gone, f"alive 10 s after the launcher died: {[p for p in pids if _not_zombie(p)]}"
    # nobody was left to write result.json but the agent, on its way out
    result = json.loads((tmp_run_dir / "result.json").read_text())
    assert result["status"] == "interrupted" and result["message"] == rundir.ORPHANED, result
    # a stopped server or a killed kernel leaves no warm process's folder (its socket) behind
    assert wait_until(lambda: not list(tmp.glob("ddp-lesson-warm-*")), 10), list(tmp.iterdir())
    shutil.rmtree(tmp, ignore_errors=True)


# -- failures --------------------------------------------------------------------------------

@pytest.mark.timeout(90)
def test_rank_killed_by_sigkill_is_explained(tmp_run_dir):
    run = launch.start(SCRIPTS / "killed.py", nproc=2, run_dir=tmp_run_dir)
    try:
        result = run.wait(timeout=60)
    finally:
        run.stop()
    assert result is not None, "the run did not end within 60 s"
    assert result["status"] == "failed" and result["returncode"] == 1
    failure = result["failure"]
    assert failure["rank"] == 1 and failure["exitcode"] == -9, failure
    assert "memory" in result["message"] and "Rank 1" in result["message"]
    assert json.loads((tmp_run_dir / "result.json").read_text())["failure"]["exitcode"] == -9


# -- elastic restart -------------------------------------------------------------------------

def _rank_process(run_dir, rank):
    """Rank `rank` of the run, alive now, from its pid file (a warm rank's environment in /proc
    is its warm process's)."""
    found = procs.recorded_file(rundir.pid_file(run_dir, f"rank{rank}"))
    return found[0] if found else None


@pytest.mark.timeout(150)
def test_max_restarts_resumes_from_checkpoint(tmp_run_dir, tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    # notebook 07's resume.py, 2 epochs (of 8,192 samples: long enough to be killed in the
    # second): rank 1 dies after epoch 0's checkpoint, the restart resumes at epoch 1
    run = launch.start(RESUME, nproc=2, run_dir=tmp_run_dir, max_restarts=1,
                       args=["--epochs", "2", "--samples", "8192", "--checkpoint", ckpt])
    try:
        assert wait_until(ckpt.exists, 90, interval=0.02), "no checkpoint was written"
        victim = _rank_process(tmp_run_dir.resolve(), 1)
        assert victim is not None and not run.done()
        victim.kill()
        result = run.wait(timeout=120)
    finally:
        run.stop()
    assert result is not None, "the run did not finish"
    assert result["status"] == "ok", result
    log0 = (tmp_run_dir / "logs" / "rank0.stdout.log").read_text()
    assert "resumed from" in log0
    record = runs.load(tmp_run_dir)
    # each rank logs an epoch as it ends: epoch 0 in the first attempt, epoch 1 in the restart,
    # which started from the checkpoint (resumed_from 1), not from scratch
    ends = {(r["rank"], r["epoch"], r["attempt"], r["resumed_from"]) for r in record.rows if "epoch" in r}
    assert {(rank, 1, 1, 1) for rank in (0, 1)} <= ends and {e[1] for e in ends} == {0, 1}, ends
    # the checkpoint was written to a .tmp and renamed (nothing half-written is left), and it
    # holds only tensors and numbers: torch.load(weights_only=True) can read it back
    assert not ckpt.with_name(ckpt.name + ".tmp").exists()
    import torch
    state = torch.load(ckpt, weights_only=True)
    assert state["epoch"] == 1 and "model" in state, sorted(state)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("max_restarts, agent_hosts", [(0, True), (1, False)])
def test_who_hosts_the_ranks_store(tmp_run_dir, max_restarts, agent_hosts):
    """00's fold on the two stores (appendix F): by default torchrun's agent hosts the ranks' store, so
    MASTER_PORT is a port the agent listens on, beside the rendezvous store's. With restarts the
    launcher sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0 hosts it, the agent does not
    listen on MASTER_PORT, and torchrun says so in each rank's TORCHELASTIC_USE_AGENT_STORE."""
    run = launch.start(FIRST_RUN, nproc=2, cpu=True, run_dir=tmp_run_dir, max_restarts=max_restarts)
    try:
        result = run.wait(timeout=90)
    finally:
        run.stop()
    assert result is not None and result["status"] == "ok", result
    rows = {r["rank"]: r for r in runs.load(tmp_run_dir).rows if "pid" in r}
    assert sorted(rows) == [0, 1] and all(r["agent_store"] is agent_hosts for r in rows.values()), rows
    port = int(rows[0]["store"].rsplit(":", 1)[1])
    assert (port in rows[0]["agent_ports"]) is agent_hosts, rows[0]
    assert [p for p in rows[0]["agent_ports"] if p != port], rows[0]   # the rendezvous store: always the agent's


# -- issue 10: supervision, identity, run directories -----------------------------------------

@pytest.mark.timeout(90)
def test_a_pythonpath_in_env_is_added_after_the_package(tmp_path, tmp_path_factory, write_script, launch_mode):
    """env={"PYTHONPATH": ...} replaces the kernel's PYTHONPATH but keeps this package first:
    the ranks import the learner's module and this copy of ddp_lesson. Python reads PYTHONPATH
    only at start-up, so the warm process cannot serve it: the launch is cold, and says why
    (its run directory sits outside tmp_path, where every launch must have gone `launch_mode`)."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "mylib.py").write_text("WHO = 'mylib'\n")
    script = write_script("uses_lib.py", """
        import os, mylib, ddp_lesson
        print(mylib.WHO, ddp_lesson.__file__, os.environ["PYTHONPATH"], flush=True)
        """)
    run = launch.start(script, nproc=1, cpu=True, run_dir=tmp_path_factory.mktemp("pythonpath") / "run",
                       env={"PYTHONPATH": str(lib)})
    try:
        result = run.wait(timeout=60)
    finally:
        run.stop()
    assert result["status"] == "ok", (result, runs.log_tail(run.run_dir, 0, 30, "stderr"))
    assert runs.log_tail(run.run_dir, 0, 5).split() == ["mylib", str(REPO / "ddp_lesson" / "__init__.py"),
                                          os.pathsep.join([launch.PACKAGE_PARENT, str(lib)])]
    assert launch.PACKAGE_PARENT == str(REPO)
    assert run.config["launch"]["mode"] == "cold"
    if launch_mode == "warm":
        assert run.config["launch"]["why"].startswith("PYTHONPATH differs"), run.config["launch"]


@pytest.mark.timeout(90)
def test_a_vanished_run_directory_still_ends_the_run_with_a_result(tmp_path, write_script):
    """A learner clearing runs/ while a run goes must not leave wait() hanging forever."""
    import shutil
    script = write_script("tiny.py", "import time\nprint('ready', flush=True)\ntime.sleep(1)\n")
    run = launch.start(script, nproc=1, cpu=True, run_dir=tmp_path / "run")
    try:
        assert run.wait_done(0.01) is False and run.elapsed >= 0
        # the run keeps writing while it goes (a warm one from its first milliseconds): clear
        # it until it is gone, as a learner's `rm -rf runs/` would have to
        deadline = time.monotonic() + 10
        while (tmp_path / "run").exists() and time.monotonic() < deadline:
            shutil.rmtree(tmp_path / "run", ignore_errors=True)
        result = run.wait(timeout=60)
    finally:
        run.stop()
    assert result is not None and run.wait_done(0) is True
    assert result["status"] in ("ok", "failed") and result.get("message", "") or result["status"] == "ok"
    assert run.stop() is result


@pytest.mark.timeout(90)
def test_two_starts_cannot_share_one_run_directory(tmp_path, write_script):
    script = write_script("tiny.py", "print('hi')\n")
    barrier = threading.Barrier(2)
    outcomes = []

    def go():
        barrier.wait()
        try:
            outcomes.append(launch.start(script, nproc=1, cpu=True, run_dir=tmp_path / "shared"))
        except launch.BadInput as e:
            outcomes.append(e)
    threads = [threading.Thread(target=go) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    started = [o for o in outcomes if isinstance(o, launch.Run)]
    for run in started:
        run.wait(timeout=60)
        run.stop()
    assert len(started) == 1, outcomes


@pytest.mark.timeout(30)
def test_end_tree_never_signals_a_reused_pid():
    """stop() after the agent was reaped: the PID may belong to someone else by now."""
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        stale = psutil.Process(bystander.pid)
        stale._create_time = stale.create_time() - 100  # as if an earlier process had had this PID
        stale._ident = (stale.pid, stale._create_time)  # (psutil's identity check reads both)
        procs.end_tree(stale, grace=0.2)
        time.sleep(0.2)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
