"""A run is private to its user (issue 42): its network, its folders, its live world's door.

The two-user tests run as root: root launches, and a second Unix user (made here with
useradd, removed after) probes with the system's Python. They skip, saying why, elsewhere."""
import json
import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from conftest import wait_until
from ddp_lesson.launcher import isolation, launch
from ddp_lesson.rank import rundir
from ddp_lesson.notebook.lesson import work_dir

OTHER = "ddplesson-other"
PROBE_PYTHON = "/usr/bin/python3"   # the other user's own interpreter: it needs no torch

# each rank says where it is, then waits for the test's go (a file in its run directory)
SCRIPT = textwrap.dedent("""\
    import json, os, time
    import torch.distributed as dist
    dist.init_process_group("gloo")
    print(json.dumps({"rank": dist.get_rank(), "net": os.readlink("/proc/self/ns/net"),
                      "port": int(os.environ["MASTER_PORT"]), "uid": os.getuid()}), flush=True)
    go = os.path.join(os.environ["DDP_LESSON_RUN_DIR"], "go")
    end = time.monotonic() + 60
    while not os.path.exists(go) and time.monotonic() < end:
        time.sleep(0.05)
    dist.barrier()
""")


def needs_namespaces():
    if not isolation.status().isolated:
        pytest.skip(f"this machine refuses private networks: {isolation.status().why}")


@pytest.fixture(scope="module")
def other_user():
    """A second Unix user (root only): made here if missing, removed after if made here."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a second Unix user (useradd) and run as it (runuser)")
    if not (shutil.which("useradd") and shutil.which("runuser") and os.path.exists(PROBE_PYTHON)):
        pytest.skip("needs useradd, runuser and /usr/bin/python3")
    try:
        pwd.getpwnam(OTHER)
        made = False
    except KeyError:
        subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", OTHER], check=True)
        made = True
    yield OTHER
    if made:
        subprocess.run(["userdel", OTHER], check=False)


def as_other(user, code, *args):
    """Run `code` as `user` with the system's Python; its printed JSON."""
    p = subprocess.run(["runuser", "-u", user, "--", PROBE_PYTHON, "-c", code, *map(str, args)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


PROBE = textwrap.dedent("""\
    import json, os, socket, sys
    port, run_dir, base = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    out = {}
    def attempt(name, fn):
        try:
            fn()
            out[name] = "ok"
        except OSError as e:
            out[name] = type(e).__name__
    attempt("connect_store", lambda: socket.create_connection(("127.0.0.1", port), timeout=5).close())
    attempt("list_base", lambda: os.listdir(base))
    attempt("list_run", lambda: os.listdir(run_dir))
    attempt("read_config", lambda: open(os.path.join(run_dir, "config.json")).read())
    print(json.dumps(out))
""")


def shared_base():
    """A runs folder any user may look into (as a home made 0755 would be)."""
    base = Path(tempfile.mkdtemp(prefix="ddp-lesson-test-"))
    os.chmod(base, 0o755)
    return base


def start_and_wait_ready(script_path, base, **kw):
    run = launch.start(script_path, nproc=2, cpu=True, run_dir=base / "run", timeout=120, **kw)
    lines = wait_until(lambda: _ready_lines(run), timeout=90, interval=0.1)
    assert lines, f"the ranks never said where they are: {run.wait(1)}"
    return run, lines


def _ready_lines(run):
    try:
        text = rundir.rank_log(run.run_dir, 0, "stdout").read_text()
    except OSError:
        return None
    return [json.loads(t) for t in text.splitlines() if t.startswith("{")] or None


def finish(run):
    (run.run_dir / "go").touch()
    res = run.wait(90)
    assert res and res["status"] == "ok", res


def test_a_single_node_run_has_a_network_no_other_user_can_reach(other_user, tmp_path):
    needs_namespaces()
    path = tmp_path / "where.py"
    path.write_text(SCRIPT)
    base = shared_base()
    try:
        run, (hello,) = start_and_wait_ready(path, base)
        try:
            assert json.loads(rundir.config(run.run_dir).read_text())["isolation"]["private_network"] is True
            assert hello["net"] != os.readlink("/proc/self/ns/net"), "the rank shares the kernel's network"
            assert hello["uid"] == os.getuid()   # still this user inside
            probe = as_other(other_user, PROBE, hello["port"], run.run_dir, base)
            # the store's port exists only in the run's network; the folder is 0700
            assert probe == {"connect_store": "ConnectionRefusedError", "list_base": "ok",
                             "list_run": "PermissionError", "read_config": "PermissionError"}, probe
            # not even this user, outside the run's network, can reach the store
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", hello["port"]), timeout=5).close()
        finally:
            finish(run)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_without_a_private_network_the_store_is_reachable(other_user, tmp_path, monkeypatch):
    """The control: the same probe finds the store of a run on the shared network (so the
    test above would catch a run that is not isolated)."""
    monkeypatch.setattr(isolation, "status", lambda: isolation.Status(False, "turned off by the test"))
    path = tmp_path / "where.py"
    path.write_text(SCRIPT)
    base = shared_base()
    try:
        run, (hello,) = start_and_wait_ready(path, base, cold=True)   # the warm process is in its own network
        try:
            assert hello["net"] == os.readlink("/proc/self/ns/net")
            probe = as_other(other_user, PROBE, hello["port"], run.run_dir, base)
            assert probe["connect_store"] == "ok" and probe["list_run"] == "PermissionError", probe
        finally:
            finish(run)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_warm_socket_and_world_door_folders_keep_other_users_out(other_user):
    """The Unix sockets that cross from the kernel live in 0700 folders: another user's
    connect is refused by the file system, whatever network it is in."""
    folder = Path(isolation.private_dir("ddp-lesson-door-"))
    try:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(folder / "door"))
        listener.listen(1)
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        code = ("import json, socket, sys\ns = socket.socket(socket.AF_UNIX)\n"
                "try:\n    s.connect(sys.argv[1]); print(json.dumps('ok'))\n"
                "except OSError as e:\n    print(json.dumps(type(e).__name__))\n")
        assert as_other(other_user, code, folder / "door") == "PermissionError"
        listener.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_folders_and_files_are_private_whatever_the_umask(tmp_path, monkeypatch):
    old = os.umask(0)
    try:
        run_dir = rundir.create(tmp_path / "runs" / "a" / "run")
        rundir.write_json(rundir.config(run_dir), {"token": "secret"})
        rundir.write_bytes(rundir.world_key(run_dir), b"key", private=True)
        monkeypatch.chdir(tmp_path)
        work = work_dir("work/sub")
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
    for folder in (tmp_path / "runs", tmp_path / "runs" / "a", run_dir, rundir.logs(run_dir),
                   rundir.metrics(run_dir), tmp_path / "work", work):
        assert mode(folder) == 0o700, folder
    assert mode(rundir.config(run_dir)) == 0o600
    assert mode(rundir.world_key(run_dir)) == 0o600


def test_a_refused_namespace_is_said_in_one_line():
    line = isolation.Status(False, "this OS refuses an unprivileged network namespace: EPERM").line()
    assert "NOT isolated" in line and "other users" in line and "container" in line
    assert "no other user" in isolation.Status(True).line()
    assert isolation.for_run(single_node=False).isolated is False


def test_doctor_counts_other_users_and_gives_a_fair_share(other_user):
    """Another user's warm process (seen by its command line, as doctor sees a real one):
    doctor names one other user and halves this learner's share of cores and memory."""
    import io

    from ddp_lesson.launcher import devices, doctor
    before = len(doctor.other_users())
    other = subprocess.Popen([PROBE_PYTHON, "-c", "import time; time.sleep(60)", "-m", "ddp_lesson.rank.warm.server"],
                             user=other_user, group=pwd.getpwnam(other_user).pw_gid, extra_groups=[])
    try:
        assert wait_until(lambda: len(doctor.other_users()) == before + 1, 10)
        out = io.StringIO()
        doctor.check_sharing(out)
    finally:
        other.kill()
        other.wait()
    share = devices.cpu_count() / (2 + before)
    assert f"{before + 1} other user(s) have ddp_lesson runs" in out.getvalue(), out.getvalue()
    assert f"your fair share: about {share:.1f} core(s)" in out.getvalue(), out.getvalue()


def test_a_run_without_a_private_network_says_so_first(tmp_path, repo_env):
    """Where runs cannot be isolated (here: turned off), the CLI's first line says that other
    users could reach the run, and config.json says why."""
    import sys
    script = tmp_path / "hi.py"
    script.write_text("print('hi')\n")
    env = dict(repo_env, **{isolation.SHARED_ENV: "1"})
    p = subprocess.run([sys.executable, "-m", "ddp_lesson", "run", "--nproc", "1", "--cpu", "--cold",
                        "--run-dir", str(tmp_path / "run"), str(script)],
                       env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stderr.splitlines()[0].startswith("warning: runs are NOT isolated"), p.stderr
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["isolation"] == {"private_network": False, "why": f"{isolation.SHARED_ENV}=1 is set"}


NS_SCRIPT = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    print("NET", os.readlink("/proc/self/ns/net"), int(t.item()), flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("mode", ["warm", "cold"])
def test_every_rank_of_a_run_shares_one_private_network(mode, tmp_path):
    """A warm launch forks rank R in warm process R (one per local rank): those processes must
    all live in the network warm process 0 made, where the agent's store is, or ranks 1..N-1
    cannot reach it. 3 ranks, so a rank past the first peer is covered too."""
    needs_namespaces()
    script = tmp_path / "ns.py"
    script.write_text(NS_SCRIPT)
    run = launch.start(script, nproc=3, cpu=True, cold=(mode == "cold"), run_dir=tmp_path / "run")
    result = run.wait()
    assert result["status"] == "ok", result
    assert run.config["launch"]["mode"] == mode, run.config["launch"]
    nets = set()
    for r in range(3):
        out = (Path(run.run_dir) / "logs" / f"rank{r}.stdout.log").read_text()
        net, total = out.split("NET ", 1)[1].split()[:2]
        assert total == "3", out
        nets.add(net)
    assert len(nets) == 1, f"ranks in different networks: {nets}"
    assert nets != {os.readlink("/proc/self/ns/net")}, "the ranks used this machine's network"


SLOW_MAKER = """
import ctypes, os, sys, time
from ddp_lesson.rank import netns
uid, gid = os.geteuid(), os.getegid()
assert ctypes.CDLL(None, use_errno=True).unshare(netns.CLONE_NEWUSER | netns.CLONE_NEWNET) == 0
print("unshared", flush=True)
time.sleep(1)   # a warm process 0 that made its namespaces and has not mapped its ids yet
for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
    with open(f"/proc/self/{name}", "w") as f:
        f.write(text)
time.sleep(60)
"""


def test_a_process_that_joins_a_network_keeps_what_its_maker_has(repo_env):
    """netns.join waits for the maker's id maps: a peer warm process that joined before them
    exec'd as an unmapped user, lost its capabilities (root only: a user keeps none anyway),
    and its ranks got EACCES opening /proc/<agent>/fd/1 (the agent kept them)."""
    needs_namespaces()
    if os.geteuid() != 0:
        pytest.skip("only root keeps capabilities across exec in a namespace it maps to itself")
    maker = subprocess.Popen([sys.executable, "-c", SLOW_MAKER], env=repo_env, stdout=subprocess.PIPE, text=True)
    try:
        assert maker.stdout.readline().strip() == "unshared"
        show = "print([l for l in open('/proc/self/status') if l.startswith('CapEff')][0].split()[1])"
        joined = subprocess.run([sys.executable, isolation.NETNS, "--join", str(maker.pid), sys.executable, "-c", show],
                                env=repo_env, capture_output=True, text=True, timeout=60)
        assert joined.returncode == 0, joined.stderr
        assert int(joined.stdout, 16) != 0, "the joined process lost its capabilities at exec"
    finally:
        maker.kill()
        maker.wait()
