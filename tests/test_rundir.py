"""The run directory has one owner, ddp_lesson/rank/rundir.py: its names, the variable that points
a process at it, creation and atomic writes. Other package modules go through it, and the shipped
scripts through metrics (run_dir, save_json, checkpoint_path)."""
import ast
import os
import stat
from pathlib import Path

import pytest

from ddp_lesson.rank import metrics, rundir

PACKAGE = Path(rundir.__file__).parents[1]   # ddp_lesson/, whose rank/ holds rundir.py
NAMES = ("config.json", "result.json", "script.py", "agent.log", "agent.failures.json", ".jsonl",
         ".error.json", ".stack.log", "stdout.log", "stderr.log", "world.key", "model.pt",
         "DDP_LESSON_RUN_DIR", "DDP_LESSON_RUN_TOKEN")


def test_paths_of_a_run_directory(tmp_path):
    run = rundir.create(tmp_path / "r")
    assert run.is_absolute() and rundir.logs(run).is_dir() and rundir.metrics(run).is_dir()
    assert rundir.metrics_file(run, 3) == run / "metrics" / "rank3.jsonl"
    assert rundir.rank_log(run, 1, "stderr") == run / "logs" / "rank1.stderr.log"
    assert rundir.rank_log_of("rank12.stdout.log") == (12, "stdout")
    assert rundir.rank_log_of("rank1.stack.log") is None and rundir.rank_log_of("agent.log") is None
    assert rundir.is_metrics_file("rank0.jsonl") and not rundir.is_metrics_file("rank0.jsonl.tmp")
    rundir.write_json(rundir.error_file(run, 1), {"rank": 1})
    rundir.write_json(rundir.error_file(run, 0), {"rank": 0})
    assert [rundir.read_json(p)["rank"] for p in rundir.error_files(run)] == [0, 1]
    with pytest.raises(FileExistsError):      # logs/ is the claim: a second creator is refused
        rundir.create(run)


def test_from_env_and_a_new_path(monkeypatch, tmp_path):
    monkeypatch.delenv(rundir.ENV, raising=False)
    assert rundir.from_env() is None and rundir.from_env("x") == "x"
    monkeypatch.setenv(rundir.ENV, str(tmp_path))
    assert rundir.from_env() == tmp_path
    a, b = rundir.new_path(tmp_path, "my script!"), rundir.new_path(tmp_path, "my script!")
    assert a != b and a.parent == tmp_path and "-my-script-" in a.name and not a.exists()


def test_atomic_writes_and_a_private_file(tmp_path):
    path = tmp_path / "k"
    (tmp_path / "k.tmp").write_bytes(b"stale")
    os.chmod(tmp_path / "k.tmp", 0o666)
    rundir.write_bytes(path, b"secret", private=True)
    assert path.read_bytes() == b"secret" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not (tmp_path / "k.tmp").exists()
    rundir.write_json(tmp_path / "x.json", {"a": 1})
    assert rundir.read_json(tmp_path / "x.json") == {"a": 1}
    assert rundir.read_json(tmp_path / "missing.json", "dflt") == "dflt"


def literals(path):
    """The string constants of a module that are not docstrings."""
    tree = ast.parse(path.read_text())
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)}
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def spelled(paths):
    """{file: [its literals naming a run-directory file or variable]}, for the files that have any."""
    out = {}
    for path in paths:
        found = [v for v in literals(path) if any(name in v for name in NAMES)]
        if found:
            out[str(path)] = found
    return out


def test_the_run_directory_names_are_spelled_in_rundir_only():
    """No package module and no shipped script (ddp_lesson/rank/scripts/**, which the notebooks
    write out) names a file of the run directory or either environment variable itself."""
    paths = [p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "rundir.py"]
    assert any("scripts" in p.parts and p.name == "ddp_basic.py" for p in paths)   # the scripts are in
    found = spelled(paths)
    # The take-home chain runs without the course too, and then saves model.pt in the folder it
    # runs in; in the course its checkpoint still goes through metrics.checkpoint_path().
    for name in TAKE_HOME:
        path = PACKAGE / "rank" / "scripts" / "lessons" / name
        assert "metrics.checkpoint_path()" in path.read_text(), name
        left = [v for v in found.pop(str(path), []) if "model.pt" not in v]
        if left:
            found[str(path)] = left
    assert not found, found
    assert any("config.json" in v for v in literals(PACKAGE / "rank" / "rundir.py"))  # the check can see


TAKE_HOME = ("train_single.py", "ddp_basic.py", "ddp_syncbn.py", "ddp_accum.py")


def test_the_check_finds_a_script_that_spells_them(tmp_path):
    """What scripts did before metrics.run_dir(): the check names both lines, not the docstring."""
    script = tmp_path / "planted.py"
    script.write_text('''"""Saves model.pt into DDP_LESSON_RUN_DIR (a docstring may say so)."""
import os
ckpt = os.path.join(os.environ.get("DDP_LESSON_RUN_DIR", "."), "model.pt")
with open(os.path.join(os.environ["DDP_LESSON_RUN_DIR"], "amp.json"), "w") as f:
    pass
''')
    found = spelled([script])
    assert list(found) == [str(script)]
    assert sorted(found[str(script)]) == ["DDP_LESSON_RUN_DIR", "DDP_LESSON_RUN_DIR", "model.pt"]


def test_a_script_finds_the_run_directory_through_metrics(monkeypatch, tmp_path):
    monkeypatch.delenv(rundir.ENV, raising=False)
    assert metrics.run_dir() == Path(".") and metrics.checkpoint_path() == Path("model.pt")
    monkeypatch.setenv(rundir.ENV, str(tmp_path))
    assert metrics.run_dir() == tmp_path and metrics.checkpoint_path() == tmp_path / "model.pt"
    path = metrics.save_json("amp.json", {"scale": 2.0})
    assert path == tmp_path / "amp.json" and rundir.read_json(path) == {"scale": 2.0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["amp.json"]   # no temporary file left
