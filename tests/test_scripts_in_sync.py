"""Each %%writefile cell of notebooks 03-05 writes exactly the reference script in
ddp_lesson/scripts/, and each lesson script is a small diff of the previous one."""
import difflib
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "ddp_lesson" / "scripts"
NOTEBOOKS = {"03_ddp_torchrun.ipynb": ["ddp_basic.py"],
             "04_sync_batchnorm.ipynb": ["ddp_syncbn.py"],
             "05_gradient_accumulation.ipynb": ["ddp_accum.py"]}


def writefile_cells(nb_path):
    cells = json.loads(nb_path.read_text())["cells"]
    out = {}
    for c in cells:
        src = "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        if c["cell_type"] == "code" and src.startswith("%%writefile"):
            first, _, body = src.partition("\n")
            out[first.split()[-1]] = body
    return out


@pytest.mark.parametrize("notebook", sorted(NOTEBOOKS))
def test_writefile_cells_match_reference(notebook):
    cells = writefile_cells(ROOT / "notebooks" / notebook)
    assert sorted(Path(p).name for p in cells) == sorted(NOTEBOOKS[notebook])
    for target, body in cells.items():
        assert target.startswith("work/"), target
        ref = (SCRIPTS / Path(target).name).read_text()
        assert body.rstrip("\n") == ref.rstrip("\n"), f"{notebook}: {target} differs from ddp_lesson/scripts"


@pytest.mark.parametrize("old,new,max_changed", [("ddp_basic.py", "ddp_syncbn.py", 12),
                                                 ("ddp_syncbn.py", "ddp_accum.py", 30)])
def test_each_lesson_script_is_a_small_diff(old, new, max_changed):
    a, b = (SCRIPTS / old).read_text().splitlines(), (SCRIPTS / new).read_text().splitlines()
    changed = [l for l in difflib.unified_diff(a, b, lineterm="", n=0)
               if l[:1] in "+-" and not l.startswith(("+++", "---"))]
    assert 0 < len(changed) <= max_changed, "\n".join(changed)


@pytest.mark.parametrize("name", ["ddp_basic.py", "ddp_syncbn.py", "ddp_accum.py"])
def test_lesson_scripts_show_every_ddp_line(name):
    src = (SCRIPTS / name).read_text()
    for needle in ("init_process_group", '"nccl" if use_cuda else "gloo"', 'os.environ["RANK"]',
                   'os.environ["LOCAL_RANK"]', 'os.environ["WORLD_SIZE"]', "MASTER_ADDR", "MASTER_PORT",
                   "set_device", "DistributedSampler", "set_epoch", "DDP(", "model.module.state_dict()",
                   "barrier()", "map_location", "destroy_process_group", "metrics.log(", "if rank == 0"):
        assert needle in src, f"{name} lacks {needle}"
