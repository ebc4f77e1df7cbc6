"""Warm launches (`launch.warm_up`, ddp_lesson.rank.warm.server, ddp_lesson.launcher.warm): a run's agent
is forked from warm process 0 and rank R from warm process R (each has imported torch), and
each rank is still what a CLI torchrun gives it (test_warm_fidelity.py: case by case, with
plain torchrun as the reference).

- the process tree: launcher -> warm process 0 -> agent, launcher -> warm process R -> rank R, and the ranks did not import
  torch themselves; the warm process holds one thread, no CUDA and no learner-editable module;
- the same torchrun: every torchrun variable a cold rank gets, with the same values where
  they do not name a port or a run id; `__main__`, sys.argv, tracebacks on the script's own
  lines, exit codes; the script and its neighbours read fresh at every launch;
- what a fork inherits, shed: a stdio lock held by another thread at the fork (shown to hang
  without the fix), the random state of torch and numpy, torch's thread count;
- the warm process killed mid-run, two launchers at once, a stale warm process, a launch
  whose start-up environment differs, and `cleanup` of a warm process whose launcher is gone.

The launcher checks of test_launch.py run warm (the default) and cold.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from conftest import REPO, child_env, processes_under, wait_until
from ddp_lesson.launcher import doctor, launch, runs, warm
from ddp_lesson.rank import guard, procs
from ddp_lesson.rank.warm import server as warm_server

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="warm launches need Linux")

SHOW = """
import json, os, sys
info = {"torch_before": "torch" in sys.modules, "name": __name__, "argv": sys.argv[1:],
        "bad_fork": bool("torch" in sys.modules and sys.modules["torch"].cuda._is_in_bad_fork()),
        "ours_before": sorted(m for m in sys.modules if m.split(".")[0] == "ddp_lesson"),
        "env": {k: v for k, v in os.environ.items()
                if k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                         "ROLE_RANK", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
                         "PYTORCH_NVML_BASED_CUDA_CHECK")
                or k.startswith("TORCHELASTIC_")}}
import numpy, torch
info["torch_rand"] = torch.rand(3).tolist()
info["numpy_rand"] = numpy.random.rand(3).tolist()
info["threads"] = torch.get_num_threads()
info["pid"], info["ppid"] = os.getpid(), os.getppid()
out = os.path.join(os.environ["DDP_LESSON_RUN_DIR"], "show%s.json" % os.environ["RANK"])
with open(out, "w") as f:
    json.dump(info, f)
"""


# All of ddp_lesson a rank holds before its script runs, warm or cold.
# (a warm rank also holds the warm room it was forked by: its warm process is in it)
RANK_PRELOAD = {"ddp_lesson", "ddp_lesson.rank", "ddp_lesson.rank.guard", "ddp_lesson.rank.rundir"}
WARM_ROOM = {"ddp_lesson.rank.warm", "ddp_lesson.rank.warm.fork"}


def shown(run, nproc):
    return [json.loads((run.run_dir / f"show{r}.json").read_text()) for r in range(nproc)]


def launched(script, nproc=2, cold=False, args=(), **kw):
    run = launch.start(script, nproc=nproc, cpu=True, cold=cold, args=args, timeout=120, **kw)
    result = run.wait()
    return run, result


@pytest.fixture(scope="module")
def server():
    s = launch.warm_up()
    assert s is not None and s.ready(120), s and s.log_tail()
    return s


def test_warm_and_cold_ranks_get_the_same_torchrun(server, write_script, tmp_path):
    script = write_script("show.py", SHOW)
    warm_run, r = launched(script, nproc=3, args=["--lr", "0.1"])
    assert r["status"] == "ok", r
    cold_run, r = launched(script, nproc=3, cold=True, args=["--lr", "0.1"])
    assert r["status"] == "ok", r
    assert warm_run.config["launch"] == {"mode": "warm", "why": None, "warm_pid": server.pid}
    assert cold_run.config["launch"]["mode"] == "cold"
    warm_ranks, cold_ranks = shown(warm_run, 3), shown(cold_run, 3)
    agent = warm_run.config["command"]  # the equivalent cold command is kept
    assert "torch.distributed.run" in agent
    for w, c in zip(warm_ranks, cold_ranks):
        # forked from a process that had torch: not imported again; a new interpreter had not
        assert w["torch_before"] and not c["torch_before"]
        assert w["name"] == c["name"] == "__main__"
        assert not w["bad_fork"] and not c["bad_fork"]   # a warm rank may use CUDA, as a cold one may
        assert w["argv"] == c["argv"] == ["--lr", "0.1"]
        # the guard and its run directory names, nothing else of ours: not what a learner edits
        # (metrics, models, data), not the kernel's supervision (by real names: short names are aliases)
        assert set(w["ours_before"]) <= RANK_PRELOAD | WARM_ROOM and set(c["ours_before"]) <= RANK_PRELOAD, (w, c)
        assert sorted(w["env"]) == sorted(c["env"]), set(w["env"]) ^ set(c["env"])
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                  "ROLE_NAME", "MASTER_ADDR", "OMP_NUM_THREADS", "TORCHELASTIC_RESTART_COUNT",
                  "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE"):
            assert w["env"].get(k) == c["env"].get(k), k
        assert w["threads"] == c["threads"] == 1   # as OMP_NUM_THREADS says
    # a new process seeds torch and numpy from the OS; forks of one warm process would all
    # draw the same numbers unless each is seeded again
    for ranks in (warm_ranks, cold_ranks):
        for rng in ("torch_rand", "numpy_rand"):
            assert len({tuple(r[rng]) for r in ranks}) == 3, (rng, ranks)
    # the tree: rank R is a child of warm process R (its own interpreter: its own hash seed),
    # not of the agent, which warm process 0 forked
    assert [w["ppid"] for w in warm_ranks] == [s.pid for s in (server, *server.peers)][:3]
    assert {c["ppid"] for c in cold_ranks} == {cold_run.pid}


def test_the_warm_process_holds_one_thread_no_cuda_and_only_the_guard(server):
    hello = server.hello
    assert hello["threads"] == 1
    assert hello["cuda_initialized"] is False
    assert hello["forks_poisoned"] is False   # a fork of it may use CUDA: it asked no CUDA runtime
    env = dict(server.env)
    assert server.why_not(env) is None
    for planted, gpu_env, words in ((dict(hello, forks_poisoned=True), env, "asked CUDA's runtime"),
                                    (dict(hello, nvml_counts=False), dict(env, CUDA_VISIBLE_DEVICES="0,1"),
                                     "through NVML")):
        server.hello = planted   # what a poisoned warm process, or a machine without NVML, would say
        try:
            assert words in (server.why_not(gpu_env) or ""), server.why_not(gpu_env)
        finally:
            server.hello = hello
    assert server.why_not(dict(env, CUDA_VISIBLE_DEVICES="")) is None   # CPU ranks need no NVML
    assert set(hello["modules"]) <= RANK_PRELOAD | WARM_ROOM
    assert psutil.Process(server.pid).ppid() == os.getpid()


def test_edits_count_and_tracebacks_show_the_scripts_lines(server, write_script):
    write_script("helper_mod.py", "VALUE = 1\n")
    script = write_script("edit.py", textwrap.dedent("""
        import os, helper_mod
        print("value", helper_mod.VALUE, flush=True)
        if os.environ["RANK"] == "1":
            raise ValueError("planted")
    """))
    run, r = launched(script)
    assert r["status"] == "failed" and r["failure"]["rank"] == 1, r
    assert "value 1" in runs.log_tail(run.run_dir, 0)
    error = json.loads((run.run_dir / "logs" / "rank1.error.json").read_text())
    assert f'"{run.run_dir / "script.py"}", line 5' in error["traceback"], error["traceback"]
    for plumbing in ("warm/server.py", "warm/fork.py", "multiprocessing", "runpy"):
        assert plumbing not in error["traceback"], error["traceback"]
    assert error["traceback"].count("ValueError: planted") == 1
    write_script("helper_mod.py", "VALUE = 2\n")   # the module next to the script, edited
    script.write_text(script.read_text().replace('raise ValueError("planted")', "pass"))
    run, r = launched(script)
    assert r["status"] == "ok", r
    assert "value 2" in runs.log_tail(run.run_dir, 0)


@pytest.mark.parametrize("cold", [False, True], ids=["warm", "cold"])
def test_exit_codes_are_torchruns(server, write_script, cold):
    script = write_script("exit3.py", 'import os, sys\nif os.environ["RANK"] == "1": sys.exit(3)\n')
    run, r = launched(script, cold=cold)
    assert r["status"] == "failed" and r["failure"]["rank"] == 1 and r["failure"]["exitcode"] == 3, r
    assert r["returncode"] == 1   # torchrun's own exit status after a failed rank


INHERITED_LOCK = """
import os, sys, threading, time
from ddp_lesson.rank import guard
r, w = os.pipe()                       # nobody reads: a big write blocks, holding the buffer's lock
sys.stdout = open(w, "w", buffering=1024)
threading.Thread(target=lambda: (sys.stdout.write("x" * 1_000_000), sys.stdout.flush()), daemon=True).start()
time.sleep(0.5)
pid = os.fork()
if pid == 0:                           # a rank forked while another thread held the lock
    os.environ.update(RANK="0", DDP_LESSON_RUN_DIR=sys.argv[1])
    if sys.argv[2] == "shed":
        os.environ[guard.FORKED_ENV] = "1"
    guard.run_target([sys.argv[3]], rank="0")
    os._exit(0)
deadline = time.time() + 10
while time.time() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print("finished", status, file=sys.stderr)
        break
    time.sleep(0.05)
else:
    os.kill(pid, 9)
    print("hung", file=sys.stderr)
os._exit(0)   # stdout's lock is still held: an orderly exit would flush it and hang
"""


@pytest.mark.parametrize("shed", [True, False], ids=["shed", "kept"])
def test_a_rank_sheds_a_stdio_lock_it_inherited(tmp_path, write_script, repo_env, shed):
    """Without shedding, the inherited lock is never released and the rank hangs: the check
    would fail if the guard kept the inherited stdio objects."""
    harness = write_script("lock.py", INHERITED_LOCK)
    rank_script = write_script("prints.py", 'print("hello from the rank", flush=True)\n')
    run_dir = tmp_path / "lockrun"
    run_dir.mkdir()
    out = subprocess.run([sys.executable, str(harness), str(run_dir), "shed" if shed else "kept",
                          str(rank_script)], env=repo_env, capture_output=True, text=True, timeout=60)
    if shed:
        assert "finished 0" in out.stderr, out.stderr
        assert "hello from the rank" in (run_dir / "logs" / "rank0.stdout.log").read_text()
    else:
        assert "hung" in out.stderr, out.stderr


def test_killing_the_warm_process_mid_run_ends_the_run_and_the_next_launch_works(write_script):
    server = launch.warm_up()
    assert server.ready(120)
    script = write_script("sleepy.py", 'import time\nprint("ready", flush=True)\ntime.sleep(300)\n')
    run = launch.start(script, nproc=2, cpu=True, timeout=200)
    assert run.config["launch"]["mode"] == "warm"
    assert wait_until(lambda: all((run.run_dir / "logs" / f"rank{r}.stdout.log").exists()
                                  and "ready" in (run.run_dir / "logs" / f"rank{r}.stdout.log").read_text()
                                  for r in range(2)), 60)
    pids = run.pids()
    os.kill(server.pid, signal.SIGKILL)
    result = run.wait(60)
    assert result is not None and result["status"] == "failed", result
    assert "warm process" in result["message"], result
    assert wait_until(lambda: not [p for p in pids if psutil.pid_exists(p) and procs.alive(psutil.Process(p))], 30)
    _, r = launched(write_script("ok.py", "pass\n"))
    assert r["status"] == "ok", r
    assert launch.warm_up().pid != server.pid


TWO_KERNELS = """
import json, sys
from ddp_lesson.launcher import launch
run = launch.start(sys.argv[1], nproc=2, cpu=True, timeout=120)
r = run.wait()
print(json.dumps({"status": r["status"], "launch": run.config["launch"]["mode"],
                  "warm": launch.warm_up().pid}))
"""


def test_two_launchers_at_once_each_have_their_own_warm_process(write_script, repo_env):
    harness = write_script("kernel.py", TWO_KERNELS)
    script = write_script("ok2.py", "import torch.distributed as dist\ndist.init_process_group('gloo')\n"
                                    "dist.barrier()\ndist.destroy_process_group()\n")
    kernels = [subprocess.Popen([sys.executable, str(harness), str(script)], env=repo_env,
                                stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [json.loads(k.communicate(timeout=240)[0].strip().splitlines()[-1]) for k in kernels]
    assert [o["status"] for o in outs] == ["ok", "ok"]
    assert [o["launch"] for o in outs] == ["warm", "warm"]
    assert outs[0]["warm"] != outs[1]["warm"]


def test_a_stale_warm_process_is_replaced(server, write_script, monkeypatch):
    script = write_script("ok3.py", "pass\n")
    monkeypatch.setattr(warm, "fingerprint", lambda: "upgraded")   # as if torch or the package changed
    run, r = launched(script)
    assert r["status"] == "ok" and run.config["launch"]["mode"] == "cold", run.config["launch"]
    assert "changed on disk" in run.config["launch"]["why"]
    fresh = launch.warm_up()
    assert fresh.pid != server.pid and not server.alive()
    monkeypatch.undo()
    assert fresh.ready(120)
    run, r = launched(script)
    assert r["status"] == "ok" and run.config["launch"]["mode"] == "warm"


def test_the_fingerprint_follows_the_files(tmp_path):
    for name in warm_server.OWN_FILES:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    before = warm_server.fingerprint(tmp_path)
    assert warm_server.fingerprint(tmp_path) == before
    (tmp_path / "rank" / "guard.py").write_text("x = 2\n")
    assert warm_server.fingerprint(tmp_path) != before


def test_a_start_up_variable_that_differs_makes_the_launch_cold(write_script):
    launch.warm_up().ready(120)
    run, r = launched(write_script("ok4.py", "pass\n"), env={"TORCH_LOGS": "+dynamo"})
    assert r["status"] == "ok"
    assert run.config["launch"] == {"mode": "cold", "warm_pid": None,
                                    "why": "TORCH_LOGS differs from the warm process's, and it is read only at start-up"}


def test_cleanup_ends_a_warm_process_whose_launcher_is_gone(repo_env, tmp_path):
    started = []
    # ours, and one whose launcher "PID 1 started at 0" is not alive (PID 1 started later)
    for owner in (f"{os.getpid()} {procs.create_time(os.getpid())}", "1 0.0"):
        env = dict(repo_env, **{procs.FOR_ENV: owner})
        started.append(subprocess.Popen([sys.executable, "-m", "ddp_lesson.rank.warm.server", "--parent",
                                         str(os.getpid()), str(tmp_path / f"s{len(started)}")],
                                        env=env, stdout=subprocess.PIPE, start_new_session=True))
    try:
        found = procs.warm_processes()
        assert {p.pid for p in found} >= {s.pid for s in started}
        out = tmp_path / "out.txt"
        with open(out, "w") as f:
            doctor.cleanup(out=f)
        assert started[1].wait(10) is not None            # its launcher "1 0.0" is not alive
        assert started[0].poll() is None                  # ours is: spared
        assert f"pid {started[1].pid}: a warm process whose launcher is gone" in out.read_text()
    finally:
        for s in started:
            s.kill()
            s.wait()


def test_a_script_that_leaves_with_os_exit_0_ends_warm_and_cold(server, write_script):
    """torchrun collects a forked rank's result when it returns: os._exit(0) must still end
    the run (course scripts leave that way to skip a DDP object's destructor)."""
    script = write_script("osexit.py", textwrap.dedent("""
        import os, sys, torch.distributed as dist
        dist.init_process_group("gloo")
        dist.barrier()
        print("done", flush=True)
        os._exit(0)
    """))
    for cold in (False, True):
        run, r = launched(script, cold=cold)
        assert r["status"] == "ok", r
        assert "done" in runs.log_tail(run.run_dir, 1)


def fresh_warm_process():
    """Replace this launcher's warm processes by new ones, made with the environment as it is now."""
    assert launch.warm_up().ready(120)   # the one there is up, so warm_up can see it stale
    with pytest.MonkeyPatch.context() as m:
        m.setattr(warm, "fingerprint", lambda: "upgraded")   # as if torch or the package changed
        server = launch.warm_up()
    assert server.ready(120), server.log_tail()
    return server


def test_an_idle_warm_process_exits_and_the_next_launch_starts_one(write_script, monkeypatch):
    """DDP_LESSON_WARM_IDLE_S: warm processes with nothing to do exit and remove their folders;
    the next launch starts new ones and is warm; launches that meet one exiting still end ok."""
    script = write_script("idle.py", "import torch.distributed as dist\ndist.init_process_group('gloo')\n"
                                     "dist.barrier()\ndist.destroy_process_group()\n")
    monkeypatch.setenv(warm.IDLE_ENV, "3")
    monkeypatch.setattr(warm, "PEER_GRACE_S", 1)
    server = fresh_warm_process()
    run, r = launched(script)
    assert r["status"] == "ok" and run.config["launch"]["mode"] == "warm", (r, run.config["launch"])
    assert launch.warm_up() is server
    folders = [s.dir for s in (server, *server.peers)]
    assert len(folders) == 2
    t0 = time.monotonic()
    assert wait_until(lambda: not server.alive() and not any(os.path.exists(f) for f in folders), 60), \
        (server.alive(), [f for f in folders if os.path.exists(f)])
    assert time.monotonic() - t0 > 1, "it waited for its idle time"
    run, r = launched(script)
    assert r["status"] == "ok" and run.config["launch"]["mode"] == "warm", (r, run.config["launch"])
    assert launch.warm_up().pid != server.pid
    # launches that arrive as warm processes reach their idle end: warm or cold, never failed
    monkeypatch.setenv(warm.IDLE_ENV, "0.5")
    monkeypatch.setattr(warm, "PEER_GRACE_S", 0)
    fresh_warm_process()
    modes = []
    for pause in (0.3, 0.5, 0.6, 0.45):
        time.sleep(pause)
        run, r = launched(script)
        assert r["status"] == "ok", r
        modes.append(run.config["launch"]["mode"])
    assert set(modes) <= {"warm", "cold"}, modes


def test_a_warm_process_whose_socket_is_gone_is_replaced():
    """A launch must not pick warm processes it cannot reach (one exiting removes its folder
    first): such a set is not alive, and the next warm_up() starts a new one."""
    s = launch.warm_up()
    assert s is not None and s.ready(120), s and s.log_tail()
    os.unlink(s.path)
    assert not s.alive()
    fresh = launch.warm_up()
    assert fresh is not s and fresh.ready(120), fresh.log_tail()
    assert fresh.alive()
