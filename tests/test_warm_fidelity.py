"""A warm launch is what plain torchrun gives a script, and so is a cold one (issue 41).

Each case runs one tiny 2-rank script three ways: warm, cold (launch.start) and under plain
`python -m torch.distributed.run --standalone`, the reference; what the ranks saw is compared.

- probe.py: a hash seed per rank; a MainProcess whose start method is free (`set_start_method`
  works); `__file__`, argv[0] and argparse's prog name the learner's own file, and a file beside
  it is found; a launcher's OMP_NUM_THREADS and TMPDIR are what the ranks get; a non-daemon
  thread's work after the script's last line is done;
- exits.py: os._exit(0) from a watchdog thread ends a rank whose main thread still sleeps, and
  os._exit(0) inside `try/except BaseException` is not an exception;
- startvars.py: variables read when torch or Python start, set by the script before
  `import torch` or in the launch's environment, take effect: the warm launch goes cold and says why;
- a SIGTERM handler that ends in sys.exit(0) ends its rank without torchrun's SIGKILL;
- a warm process replaced mid-run (a stale fingerprint) lets that run finish;
- the fingerprint follows the installed packages' folders (a new .pth, an upgrade);
- an OMP_NUM_THREADS above the core count gives the thread count torchrun's ranks get.
"""
import json
import os
import sys
import textwrap

import pytest

from conftest import child_env, plain_torchrun, wait_until
from ddp_lesson.launcher import launch, runs, warm
from ddp_lesson.rank.warm import server as warm_server

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="warm launches need Linux")

MODES = ["warm", "cold", "torchrun"]

PROBE = """
import argparse, json, multiprocessing as mp, os, sys, tempfile, threading, time
mp.set_start_method("spawn")          # tutorials do this first; a forked worker could not
parser = argparse.ArgumentParser()
beside = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "data.txt")).read()
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
info = {"hash": hash("ddp-lesson"), "start": mp.get_start_method(), "process": mp.current_process().name,
        "parent": mp.parent_process() is None, "file": os.path.basename(__file__),
        "argv0": os.path.basename(sys.argv[0]), "prog": parser.prog, "beside": beside,
        "threads": torch.get_num_threads(), "tmp": tempfile.gettempdir()}
dist.barrier()
dist.destroy_process_group()
out = os.environ["FIDELITY_OUT"]

def late():
    time.sleep(1)
    with open(os.path.join(out, "late%d" % rank), "w") as f:
        f.write("done")

threading.Thread(target=late).start()   # not a daemon: its work after the last line counts
with open(os.path.join(out, "rank%d.json" % rank), "w") as f:
    json.dump(info, f)
"""

EXITS = """
import os, threading, time
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 0:   # a watchdog thread ends a rank whose main thread is stuck
    threading.Thread(target=lambda: (time.sleep(0.5), os._exit(0)), daemon=True).start()
    time.sleep(100)
try:
    os._exit(0)
except BaseException:
    os._exit(1)
"""

STARTVARS = """
import json, os, sys
os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
os.environ["OMP_NUM_THREADS"] = "2"
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
info = {"debug": str(dist.get_debug_level()), "threads": torch.get_num_threads(),
        "optimize": sys.flags.optimize, "hash": hash("ddp-lesson")}
dist.barrier()
dist.destroy_process_group()
with open(os.path.join(os.environ["FIDELITY_OUT"], "rank%d.json" % int(os.environ["RANK"])), "w") as f:
    json.dump(info, f)
"""


@pytest.fixture(scope="module")
def server():
    s = launch.warm_up()
    assert s is not None and s.ready(120), s and s.log_tail()
    return s


def run_three_ways(mode, script, out, env=()):
    """Run `script` on 2 CPU ranks `mode`; the ranks write under `out`. Returns (status, launch)."""
    out.mkdir()
    env = {"FIDELITY_OUT": str(out), **dict(env)}
    if mode == "torchrun":
        done = plain_torchrun(script, env=child_env(**env), cwd=script.parent)
        return ("ok" if done.returncode == 0 else done.stderr[-3000:]), None
    run = launch.start(script, nproc=2, cpu=True, cold=mode == "cold", timeout=120, env=env)
    result = run.wait()
    return (result["status"] if result["status"] == "ok" else result), run.config["launch"]


def ranks(out):
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("mode", MODES)
def test_a_rank_sees_what_torchrun_gives_it(server, mode, write_script, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")       # the launcher's: kept, as torchrun keeps it
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))           # read when a rank first asks, not at start
    write_script("data.txt", "beside the script")
    script = write_script("probe.py", PROBE)
    out = tmp_path / "out"
    status, how = run_three_ways(mode, script, out)
    assert status == "ok", status
    if mode != "torchrun":
        assert how["mode"] == mode, how
    seen = ranks(out)
    assert seen[0]["hash"] != seen[1]["hash"]        # each rank its own hash seed
    for info in seen:
        assert info["start"] == "spawn" and info["process"] == "MainProcess" and info["parent"], info
        assert info["file"] == info["argv0"] == info["prog"] == "probe.py", info
        assert info["beside"] == "beside the script"
        assert info["threads"] == 2, info
        assert info["tmp"] == str(tmp), info
    assert wait_until(lambda: all((out / f"late{r}").exists() for r in range(2)), 10)


@pytest.mark.parametrize("mode", MODES)
def test_os_exit_ends_the_process_at_once(server, mode, write_script, tmp_path):
    script = write_script("exits.py", EXITS)
    status, how = run_three_ways(mode, script, tmp_path / "out")
    assert status == "ok", status                      # in 100 s: the run's timeout is 120 s


def test_start_up_variables_take_effect_warm_by_going_cold(server, write_script, tmp_path):
    script = write_script("startvars.py", STARTVARS)
    env = {"PYTHONOPTIMIZE": "1", "PYTHONHASHSEED": "7"}
    status, _ = run_three_ways("torchrun", script, tmp_path / "ref", env)
    assert status == "ok", status
    reference = ranks(tmp_path / "ref")
    assert reference[0]["debug"].endswith("DETAIL") and reference[0]["threads"] == 2
    assert reference[0]["optimize"] == 1 and reference[0]["hash"] == reference[1]["hash"]
    status, how = run_three_ways("warm", script, tmp_path / "warm", env)
    assert status == "ok", status
    assert how["mode"] == "cold" and "read" in how["why"] and "start" in how["why"], how
    assert ranks(tmp_path / "warm") == reference
    # the script's own settings alone make the launch cold too, and say which one
    status, how = run_three_ways("warm", script, tmp_path / "warm2")
    assert how["mode"] == "cold" and "the script sets TORCH_DISTRIBUTED_DEBUG" in how["why"], how


@pytest.mark.parametrize("cold", [False, True], ids=["warm", "cold"])
def test_a_sigterm_handler_that_exits_0_ends_its_rank(server, cold, write_script, tmp_path):
    script = write_script("term.py", textwrap.dedent("""
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        print("ready", flush=True)
        time.sleep(100)
    """))
    run = launch.start(script, nproc=2, cpu=True, cold=cold, timeout=120)
    assert run.config["launch"]["mode"] == ("cold" if cold else "warm")
    assert wait_until(lambda: all("ready" in runs.log_tail(run.run_dir, r) for r in range(2)), 90)
    result = run.stop()
    assert result["status"] == "interrupted", result
    agent_log = (run.run_dir / "logs" / "agent.log").read_text()
    assert "forcefully exiting" not in agent_log, agent_log   # torchrun had to SIGKILL it


def test_a_replaced_warm_process_lets_its_running_run_finish(server, write_script, tmp_path, monkeypatch):
    go = tmp_path / "go"
    script = write_script("waits.py", textwrap.dedent(f"""
        import os, time
        print("ready", flush=True)
        while not os.path.exists({str(go)!r}):
            time.sleep(0.05)
    """))
    run = launch.start(script, nproc=2, cpu=True, timeout=120)
    assert run.config["launch"]["mode"] == "warm"
    assert wait_until(lambda: all("ready" in runs.log_tail(run.run_dir, r) for r in range(2)), 90)
    monkeypatch.setattr(warm, "fingerprint", lambda: "upgraded")   # as after a git pull or an upgrade
    fresh = launch.warm_up()
    assert fresh is not server
    monkeypatch.undo()
    go.write_text("")
    result = run.wait(60)
    assert result is not None and result["status"] == "ok", result
    assert wait_until(lambda: not server.alive(), 30)   # drained: it exits once its runs ended


def test_the_fingerprint_follows_the_installed_packages(tmp_path, monkeypatch):
    site_packages = tmp_path / "site-packages"
    site_packages.mkdir()
    monkeypatch.setattr(warm_server.site, "getsitepackages", lambda: [str(site_packages)])
    before = warm_server.fingerprint()
    assert warm_server.fingerprint() == before
    (site_packages / "__editable__.mylib.pth").write_text("/somewhere\n")   # a new `pip install -e`
    os.utime(site_packages, ns=(1, 1))   # whatever the clock's resolution
    assert warm_server.fingerprint() != before


# Every private torch or CPython API the warm machinery relies on (the rank/warm/ room,
# rank/guard.py's exit code): an upgrade that moves one
# fails here, in one place. (name, check) where check raises or returns False if it moved.
def _private_apis():
    import atexit
    import inspect
    import torch
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler
    start_src = inspect.getsource(api.SubprocessContext._start)
    return [
        # warm.ranks.install: SubprocessContext makes each rank's handler through this module
        # global, and the handler starts the rank in _popen(args, env) with these attributes
        ("api.get_subprocess_handler, called by SubprocessContext._start",
         lambda: callable(api.get_subprocess_handler) and "get_subprocess_handler(" in start_src),
        ("SubprocessHandler._popen(self, args, env)",
         lambda: list(inspect.signature(SubprocessHandler._popen).parameters) == ["self", "args", "env"]),
        ("SubprocessHandler.__init__ keywords",
         lambda: list(inspect.signature(SubprocessHandler.__init__).parameters) == [
             "self", "entrypoint", "args", "env", "stdout", "stderr", "local_rank_id", "numa_options"]),
        ("SubprocessHandler._stdout/_stderr/local_rank_id set before _popen",
         lambda: inspect.getsource(SubprocessHandler.__init__).index("self._stdout")
         < inspect.getsource(SubprocessHandler.__init__).index("self._popen(")),
        ("SubprocessHandler.close signals the rank's process group (a warm rank calls setsid)",
         lambda: "os.killpg(self.proc.pid" in inspect.getsource(SubprocessHandler.close)),
        ("SubprocessContext uses only proc.poll/pid/wait of a handle",
         lambda: all(w in inspect.getsource(api.SubprocessContext)
                     for w in ("proc.poll()", "proc.pid", "proc.wait("))),
        # warm.server: may a fork use CUDA, can NVML count GPUs
        ("torch.cuda._is_in_bad_fork", lambda: callable(torch.cuda._is_in_bad_fork)),
        ("torch.cuda._raw_device_count_nvml", lambda: callable(torch.cuda._raw_device_count_nvml)),
        # guard._exit_rank: atexit handlers run before os._exit
        ("atexit._run_exitfuncs", lambda: callable(atexit._run_exitfuncs)),
        # rundir.start_ticks (pid files): proc(5) field 22 of /proc/self/stat, the start time
        ("/proc/self/stat has starttime (field 22)",
         lambda: len(open("/proc/self/stat").read().rsplit(")", 1)[1].split()) >= 22 - 2),
    ]


def test_every_private_api_the_warm_machinery_uses_is_where_it_was():
    moved = []
    for name, check in _private_apis():
        try:
            ok = check()
        except Exception as e:   # an attribute or a source gone
            ok, name = False, f"{name} ({type(e).__name__}: {e})"
        if not ok:
            moved.append(name)
    assert not moved, "moved in this torch/CPython: " + "; ".join(moved)
    # and the list is whole: these files name no other private torch attribute
    import re
    from conftest import REPO
    used = set()
    for f in ("rank/warm/server.py", "rank/warm/ranks.py", "rank/warm/fork.py", "rank/guard.py",
              "rank/agent.py", "rank/procs.py", "rank/rundir.py", "launcher/warm.py"):
        text = (REPO / "ddp_lesson" / f).read_text()
        used |= set(re.findall(r"\btorch(?:\.\w+)*\.(_[a-z]\w*)\(", text))
        used |= set(re.findall(r"\batexit\.(_\w+)", text))
        used |= set(re.findall(r"def (_popen)\(", text))
    listed = " ".join(name for name, _ in _private_apis())
    assert all(u in listed for u in used), used


THREADS = """
import json, os, torch
with open(os.path.join(os.environ["FIDELITY_OUT"], "rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump({"threads": torch.get_num_threads()}, f)
"""


def test_an_omp_num_threads_above_the_cores_gives_what_torchrun_gives(server, write_script, tmp_path, monkeypatch):
    """A fresh interpreter takes OMP_NUM_THREADS only up to MKL's own count of cores (ATen's
    init_num_threads sets OpenMP's count to mkl_get_max_threads()); a warm rank, a fork, must
    not take the number as it is (it did: 3 against 2 on 2 cores)."""
    monkeypatch.setenv("OMP_NUM_THREADS", str((os.cpu_count() or 1) + 1))
    script = write_script("threads.py", THREADS)
    seen = {}
    for mode in MODES:
        status, how = run_three_ways(mode, script, tmp_path / mode)
        assert status == "ok", status
        if mode != "torchrun":
            assert how["mode"] == mode, how
        seen[mode] = [info["threads"] for info in ranks(tmp_path / mode)]
    assert seen["warm"] == seen["cold"] == seen["torchrun"], seen
