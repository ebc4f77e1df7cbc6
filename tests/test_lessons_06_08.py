"""Notebooks 06-08: each has asserts and an exercise with a checker and a solution; the
failure scripts behave as 07 says. (Outputs, ids, %%writefile cells: test_notebooks_check.)"""
import json
from pathlib import Path

import pytest

from ddp_lesson import launch

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = ["06_scaling_and_performance", "07_troubleshooting", "08_multi_node"]
SCRIPTS = REPO / "ddp_lesson" / "scripts"


def cells(name):
    return json.loads((REPO / "notebooks" / f"{name}.ipynb").read_text())["cells"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_checked_with_an_exercise(name):
    code = [c for c in cells(name) if c["cell_type"] == "code"]
    text = "\n".join("".join(c["source"]) for c in code)
    assert text.count("assert ") >= 8
    assert "# solution" in text and "check_" in text          # exercise, checker, solution
    assert "clear_output" not in text


def test_hang_times_out(tmp_path):
    run = launch.start(SCRIPTS / "hang.py", nproc=2, cpu=True, timeout=20, run_dir=tmp_path / "r")
    res = run.wait()
    assert res["status"] == "timeout"


def test_crash_root_cause_and_elastic_resume(tmp_path):
    ck = str(tmp_path / "ck.pt")
    args = ["--checkpoint", ck, "--epochs", "3", "--samples", "256", "--crash-at", "1,2"]
    res = launch.start(SCRIPTS / "resume.py", nproc=2, cpu=True, args=args, timeout=120,
                       run_dir=tmp_path / "a").wait()
    assert res["status"] == "failed" and res["failure"]["rank"] == 1
    assert "simulated failure of rank 1 at epoch 1" in res["failure"]["message"]
    run = launch.start(SCRIPTS / "resume.py", nproc=2, cpu=True, args=args, max_restarts=1, timeout=180,
                       run_dir=tmp_path / "b")
    assert run.wait()["status"] == "ok"
    from ddp_lesson import runs
    rows = [r for r in runs.load(run.run_dir).rows if r["rank"] == 0]
    assert [(r["epoch"], r["attempt"], r["resumed_from"]) for r in rows] == [(1, 0, 1), (2, 1, 2)]
