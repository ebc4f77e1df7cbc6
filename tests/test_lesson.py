"""The notebooks' shared helpers (ddp_lesson.notebook.lesson)."""

import pytest

from ddp_lesson.rank import bundled
from ddp_lesson.notebook import lesson

VERDICT = """
import json, os
from pathlib import Path
if os.environ["RANK"] == "0":
    Path(os.environ["DDP_LESSON_RUN_DIR"], "v.json").write_text(json.dumps({"world": int(os.environ["WORLD_SIZE"])}))
if os.environ.get("FAIL"):
    raise SystemExit("the check failed on purpose")
"""


def test_script_diff_shows_what_changed_from_the_reference(tmp_path):
    new = tmp_path / "ddp_syncbn.py"
    new.write_text(lesson.script("ddp_basic.py").read_text().replace("import torch\n", "import torch  # edited\n", 1))
    diff = lesson.script_diff("ddp_basic.py", new)
    assert "-import torch" in diff and "+import torch  # edited" in diff
    assert [l for l in diff if l[:1] in "+-" and l[:3] not in ("+++", "---")] == ["-import torch", "+import torch  # edited"]


def test_load_script_reads_edits_without_sys_path(tmp_path, monkeypatch):
    import sys
    before = list(sys.path)
    path = lesson.work_dir(tmp_path / "work") / "ring.py"
    path.write_text("N = 1\n")
    assert lesson.load_script(path).N == 1
    path.write_text("N = 2\n")
    assert lesson.load_script(path).N == 2
    assert sys.path == before


def test_load_script_imports_its_siblings_afresh(tmp_path):
    # gpt_ddp.py imports gpt_model from its own folder, as under `python gpt_ddp.py`
    import sys
    work = lesson.work_dir(tmp_path / "work")
    (work / "main_part.py").write_text("from side_part import N\n")
    (work / "side_part.py").write_text("N = 1\n")
    assert lesson.load_script(work / "main_part.py").N == 1
    (work / "side_part.py").write_text("N = 2\n")
    assert lesson.load_script(work / "main_part.py").N == 2     # the edit counts
    assert "side_part" not in sys.modules                        # nothing left behind


def test_verdict_reads_the_json_or_says_why_the_check_failed(tmp_path, monkeypatch):
    (tmp_path / "checks").mkdir()
    (tmp_path / "checks" / "vcheck.py").write_text(VERDICT)
    monkeypatch.setattr(bundled, "ROOT", tmp_path)
    run = lesson.check("vcheck")
    assert lesson.verdict(run, "v.json") == {"world": run.config["world_size"]}
    monkeypatch.setenv("FAIL", "1")
    with pytest.raises(AssertionError, match="vcheck ended failed"):
        lesson.verdict(lesson.check("vcheck"), "v.json")


FIRST = """
import argparse, json, os
from pathlib import Path
from ddp_lesson.rank import chain
def parse_args(argv=None):
    p = argparse.ArgumentParser()
    chain.add_then(p)
    return p.parse_args(argv)
args = parse_args()
Path(os.environ["DDP_LESSON_RUN_DIR"], "a.json").write_text(json.dumps({"first": True}))
chain.then(args.then, "cpu")
"""
SECOND = """
import argparse, os, time
from pathlib import Path
def parse_args(argv=None):
    return argparse.ArgumentParser().parse_args(argv)
def run(args, device):
    go = Path(os.environ["DDP_LESSON_RUN_DIR"], "go")
    end = time.monotonic() + 120
    while not go.exists() and time.monotonic() < end:   # until the test has read a.json
        time.sleep(0.05)
    raise RuntimeError("the second script failed on purpose")
"""


def test_written_reads_a_file_before_the_run_ends_and_names_the_script_that_failed(tmp_path, monkeypatch):
    (tmp_path / "checks").mkdir()
    (tmp_path / "checks" / "wfirst.py").write_text(FIRST)
    (tmp_path / "checks" / "wsecond.py").write_text(SECOND)
    monkeypatch.setattr(bundled, "ROOT", tmp_path)
    run = lesson.check("wfirst", "--then", "wsecond", nproc=1)
    try:
        assert lesson.written(run, "a.json") == {"first": True}
        assert not run.done()                      # the second script is still waiting for "go"
        (run.run_dir / "go").touch()
        with pytest.raises(AssertionError, match=r"b\.json was not written: the run \(wfirst --then wsecond\) "
                                                 r"ended failed in wsecond: .*failed on purpose"):
            lesson.written(run, "b.json")
    finally:
        run.stop()
