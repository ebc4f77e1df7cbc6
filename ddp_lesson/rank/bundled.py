"""The scripts shipped in ddp_lesson/rank/scripts/, one folder per role; a script's name -> its path.

    lessons/    what the notebooks write out (%%writefile work/<name>.py) or show: a learner reads them
    checks/     what the notebooks and tests launch to measure a claim (lesson.check("ddp_checks"))
    exercises/  the starters a learner edits (ex_*.py, bucketed_exercise.py)
    workers/    what the package itself launches (doctor's all-reduce, scaling's ranks)

A name is unique across the folders, so callers say only the name: script("ddp_basic.py").
This is the one place that builds those paths. Standard library only: scripts in the ranks
use it too (a check that reads a lesson script).
"""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent / "scripts"
ROLES = ("lessons", "checks", "exercises", "workers")


def script(name):
    """The path of the shipped script (or folder, e.g. "launch_variants") called `name`."""
    found = [ROOT / role / name for role in ROLES if (ROOT / role / name).exists()]
    if len(found) != 1:
        where = "no folder" if not found else " and ".join(str(p.parent.name) for p in found)
        raise FileNotFoundError(f"{name}: in {where} of {ROOT} ({', '.join(ROLES)}); a name must be in exactly one")
    return found[0]


def names(role):
    """The script names of one role, sorted (folders such as launch_variants left out)."""
    return sorted(p.name for p in (ROOT / role).glob("*.py"))


def load(path):
    """Import the Python file `path` as a module, afresh on every call (so edits to a work/
    file count). While it runs, its folder comes first on sys.path, as under `python path`,
    so it imports its siblings (gpt_ddp.py: gpt_model) from there, afresh too; after it,
    sys.path and sys.modules are as they were."""
    path = Path(path).resolve()
    folder = str(path.parent)
    siblings = {p.stem for p in path.parent.glob("*.py")}
    saved = {name: sys.modules.pop(name) for name in siblings if name in sys.modules}
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
        for name in siblings:
            sys.modules.pop(name, None)
        sys.modules.update(saved)
    return module
