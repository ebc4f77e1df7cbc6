"""`python tools/notebooks.py check` passes on every notebook, and fails, naming the notebook
and the cell, when a %%writefile cell drifts from ddp_lesson/rank/scripts, writes a script that does
not exist, an output is stored, or a cell touches sys.path; `sync` repairs what it can."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_lesson.rank.bundled import script

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "tools" / "notebooks.py"


def run_tool(*args):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def test_every_notebook_passes_check():
    out = run_tool("check")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all clean" in out.stdout


# 00-05's check cells, a first line `# Just run it`, are collapsed: a learner sees their output;
# at least this many in each (03b and 03c collapse every check of their sections)
CHECK_CELLS = {"00_start_here": 4, "01_data_parallel": 1, "03_ddp_torchrun": 4, "03b_ddp_equals_one_process": 5,
               "03c_averaging_in_ddp": 7, "04_sync_batchnorm": 4, "05_gradient_accumulation": 4}


@pytest.mark.parametrize("name", sorted(CHECK_CELLS))
def test_check_cells_of_the_first_notebooks_are_collapsed(name):
    cells = json.loads((REPO / "notebooks" / f"{name}.ipynb").read_text())["cells"]
    checks = [c for c in cells if c["cell_type"] == "code" and "".join(c["source"]).startswith("# Just run it")]
    assert len(checks) >= CHECK_CELLS[name]
    assert [c["id"] for c in checks if c["metadata"].get("jupyter", {}).get("source_hidden") is not True] == []


@pytest.fixture
def notebook(tmp_path):
    """A copy of notebook 03 and a function that edits its cells as JSON."""
    path = tmp_path / "03_copy.ipynb"
    shutil.copyfile(REPO / "notebooks" / "03_ddp_torchrun.ipynb", path)

    def edit(fn):
        nb = json.loads(path.read_text())
        fn(nb["cells"])
        path.write_text(json.dumps(nb, indent=1))
        return path
    return edit


def writefile_cell(cells):
    return next(c for c in cells if "".join(c["source"]).startswith("%%writefile work/"))


def drift(cells):
    c = writefile_cell(cells)
    c["source"] = "".join(c["source"]) + "\nprint('an edit that never reached the script')\n"


def store_output(cells):
    c = next(c for c in cells if c["cell_type"] == "code")
    c["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "hi\n"}]
    c["execution_count"] = 3


def missing_script(cells):
    writefile_cell(cells)["source"] = "%%writefile work/no_such_lesson.py\nprint('hi')\n"


def sys_path(cells):
    c = next(c for c in cells if c["cell_type"] == "code")
    c["source"] = "import sys\nsys.path.insert(0, '../bench')\n" + "".join(c["source"])


def duplicate_id(cells):
    cells[1]["id"] = cells[0]["id"]


@pytest.mark.parametrize("breakage,words", [
    (drift, "differs from ddp_lesson/rank/scripts/"),
    (store_output, "stored outputs"),
    (missing_script, "writes work/no_such_lesson.py but no such script is shipped"),
    (sys_path, "touches sys.path"),
    (duplicate_id, "id is used twice"),
])
def test_check_fails_naming_notebook_and_cell(notebook, breakage, words):
    path = notebook(breakage)
    out = run_tool("check", path)
    assert out.returncode == 1, out.stdout
    assert f"{path.name} cell " in out.stdout and words in out.stdout, out.stdout


def test_sync_repairs_drift_and_strips_outputs_keeping_ids(notebook):
    path = notebook(lambda cells: (drift(cells), store_output(cells)))
    ids = [c["id"] for c in json.loads(path.read_text())["cells"]]
    out = run_tool("sync", path)
    assert out.returncode == 0, out.stdout + out.stderr
    cells = json.loads(path.read_text())["cells"]
    assert [c["id"] for c in cells] == ids
    body = "".join(writefile_cell(cells)["source"]).partition("\n")[2]
    assert body.rstrip("\n") == script("ddp_basic.py").read_text().rstrip("\n")
    assert all(not c.get("outputs") and c.get("execution_count") is None
               for c in cells if c["cell_type"] == "code")
    # 03's whole-script listing starts folded in JupyterLab; the rewritten cell stays folded
    assert writefile_cell(cells)["metadata"]["jupyter"]["source_hidden"] is True
