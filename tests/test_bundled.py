"""The shipped scripts, one folder per role (ddp_lesson.rank.bundled): every name resolves to one
file, a script imports another only from its own folder (a launch puts only that folder on
sys.path; elsewhere it goes through bundled.script), and the package data ships them all."""
import ast
import fnmatch
import tomllib
from pathlib import Path

import pytest

from ddp_lesson.rank import bundled

REPO = Path(__file__).resolve().parent.parent
SHIPPED = sorted(p for p in bundled.ROOT.rglob("*.py"))


def test_every_script_is_in_a_role_folder_and_resolves_by_name():
    assert SHIPPED and not list(bundled.ROOT.glob("*.py")), "a script outside the role folders"
    for path in SHIPPED:
        if path.parent.name in bundled.ROLES:
            assert bundled.script(path.name) == path
    assert {p.parent.name for p in SHIPPED} >= set(bundled.ROLES)
    with pytest.raises(FileNotFoundError, match="no folder"):
        bundled.script("no_such_script.py")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_a_script_imports_other_scripts_only_from_its_own_folder(path):
    names = {p.stem: p for p in SHIPPED}
    for node in ast.walk(ast.parse(path.read_text())):
        mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        for mod in mods:
            other = names.get(mod.split(".")[0])
            assert other is None or other.parent == path.parent, \
                f"{path.name} imports {other.name} from {other.parent.name}/: use bundled.load(bundled.script(...))"


def test_the_package_data_ships_every_script():
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    globs = data["ddp_lesson.rank"]   # the scripts sit in rank/, beside bundled.py
    assert (REPO / "ddp_lesson" / "launcher" / "slurm_cluster.sh").exists() and data["ddp_lesson.launcher"] == ["slurm_cluster.sh"]
    for path in SHIPPED:
        rel = path.relative_to(bundled.ROOT.parent).as_posix()
        assert any(fnmatch.fnmatch(rel, g) and rel.count("/") == g.count("/") for g in globs), rel


def test_a_notebooks_chained_scripts_share_the_first_ones_folder():
    # --then NAME imports NAME from the first script's folder (ddp_lesson/rank/chain.py): a cell that
    # launches script("A.py") ... "--then", "B" needs B.py beside A.py
    import json
    import re
    seen = 0
    for nb in sorted((REPO / "notebooks").glob("*.ipynb")):
        for cell in json.loads(nb.read_text())["cells"]:
            src = "".join(cell["source"])
            first = re.findall(r'script\("(\w+\.py)"\)', src)
            links = re.findall(r'"--then",\s*"(\w+)"', src)
            if first and links:
                seen += 1
                for name in links:
                    assert bundled.script(f"{name}.py").parent == bundled.script(first[0]).parent, (nb.name, name)
    assert seen >= 2   # notebook 07's unet_split --then hang, notebook 10's beyond_* chain
