"""`doctor` prints one ok/warn/fail line per check and passes on a healthy machine
(including a real 2-rank all_reduce); `cleanup` spares a run whose launcher is alive."""
import io
import re

import pytest

from conftest import processes_under, wait_until
from ddp_lesson.launcher import doctor, launch, runs


@pytest.mark.timeout(180)
def test_doctor_reports_every_check_and_passes_here():
    out = io.StringIO()
    code = doctor.main(out=out)
    lines = out.getvalue().splitlines()
    checks = [line for line in lines[1:-1]]
    assert checks and all(re.match(r"^(ok|warn|fail) ", line) for line in checks), lines
    text = out.getvalue()
    for what in ("torch", "NCCL", "core", "/dev/shm", "rendezvous port", "all_reduce over 2 ranks"):
        assert what in text, (what, text)
    assert code == 0, text


@pytest.mark.timeout(120)
def test_cleanup_spares_a_run_whose_launcher_is_alive(write_script, tmp_run_dir):
    script = write_script("sleeper.py", """
        import time
        print("ready", flush=True)
        time.sleep(120)
    """)
    run = launch.start(script, nproc=1, cpu=True, run_dir=tmp_run_dir)
    try:
        assert wait_until(lambda: "ready" in runs.log_tail(run.run_dir, 0), 60), \
            runs.log_tail(run.run_dir, 0, 20, "stderr")
        before = {p.pid for p in processes_under(tmp_run_dir)}
        out = io.StringIO()
        assert doctor.cleanup(out=out) == 0
        assert "sparing run" in out.getvalue() and str(tmp_run_dir) in out.getvalue()
        assert {p.pid for p in processes_under(tmp_run_dir)} == before  # nothing ended
        assert not run.done()
    finally:
        run.stop()
    assert run.status == "interrupted"


def test_doctor_warns_below_the_torch_floor_and_only_there():
    """The floor is what requirements.txt and pyproject.toml ask for, and `doctor` says when the
    installed torch is older than it."""
    from pathlib import Path
    floor = ".".join(map(str, doctor.TORCH_FLOOR))
    repo = Path(__file__).resolve().parent.parent
    assert f"torch>={floor}\n" in (repo / "requirements.txt").read_text()
    assert f'"torch>={floor}"' in (repo / "pyproject.toml").read_text()
    older = f"{doctor.TORCH_FLOOR[0]}.{doctor.TORCH_FLOOR[1] - 1}.0+cpu"
    for version, level in ((floor + "+cpu", "ok"), (older, "warn"), ("2.1.0", "warn"),
                           (f"{doctor.TORCH_FLOOR[0]}.{doctor.TORCH_FLOOR[1] + 1}.0.dev20261201", "ok")):
        out = io.StringIO()
        assert doctor.torch_floor_line(version, out) == level, (version, out.getvalue())
        assert out.getvalue().startswith(level) and version in out.getvalue()


def test_cleanup_removes_only_this_users_stale_temp_folders(tmp_path, monkeypatch):
    """A SIGKILLed kernel leaves its warm process's folder, a killed world start its door's,
    torch its torchelastic_* log folders: cleanup removes those, not a folder whose socket is
    listened on, a young one (a launch starting) or another user's."""
    import os
    import socket
    import time
    monkeypatch.setattr(doctor, "_a_run_lives", lambda: False)
    old, older = time.time() - 900, time.time() - 7200
    names = ["ddp-lesson-warm-dead", "ddp-lesson-door-nosocket", "ddp-lesson-warm-listening",
             "ddp-lesson-warm-young", "ddp-lesson-door-theirs", "torchelastic_old", "torchelastic_recent",
             "unrelated-folder"]
    for name in names:
        (tmp_path / name).mkdir()
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(tmp_path / "ddp-lesson-warm-dead" / "sock"))
    dead.close()   # the socket file stays; nobody listens on it: a SIGKILLed warm process's
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(tmp_path / "ddp-lesson-warm-listening" / "sock"))
    live.listen(1)
    for name in names:
        if name != "ddp-lesson-warm-young":
            os.utime(tmp_path / name, (older, older) if name == "torchelastic_old" else (old, old))
    if os.geteuid() == 0:
        os.chown(tmp_path / "ddp-lesson-door-theirs", 65534, 65534)   # nobody's
    try:
        out = io.StringIO()
        doctor.stale_folders(dry_run=True, out=out, tmp=tmp_path)
        assert "would remove" in out.getvalue() and all((tmp_path / n).exists() for n in names)
        removed = doctor.stale_folders(out=io.StringIO(), tmp=tmp_path)
    finally:
        live.close()
    left = sorted(p.name for p in tmp_path.iterdir())
    expect = {"ddp-lesson-warm-listening", "ddp-lesson-warm-young", "torchelastic_recent", "unrelated-folder"}
    if os.geteuid() == 0:
        expect.add("ddp-lesson-door-theirs")
    assert left == sorted(expect), (left, removed)
