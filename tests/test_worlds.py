"""The three worlds of the package, and which way imports may go.

A module's world is its folder:
- ddp_lesson/rank/: runs inside torchrun's processes (the agent's and ranks' guard, what lesson
  scripts and a live world's ranks import, and rank/scripts/, what the ranks run). Standard
  library and torch only (psutil for the guard and procs, which end process trees), and only
  other rank-side modules: a rank must never pay for, or depend on, the launcher's supervision
  or the notebook's drawing.
- ddp_lesson/launcher/: starts, supervises and reads back runs (in a notebook's kernel or the CLI).
  It may import the rank side (names, metric vocabulary), never the notebook side.
- ddp_lesson/notebook/: draws and teaches (widgets, plots, diagrams, lesson helpers). It may
  import both others.
Two files stay on top: __init__ (every process imports it, a rank and the warm process included,
so it is rank side; the one exception is `%load_ext ddp_lesson`, whose function imports the
notebook side's magics when called) and __main__ (the command line, launcher side). Every module
has one name, its path (`from ddp_lesson.launcher import launch`), in the package, the lesson
scripts, the notebooks and the tests alike: the layout shows in every import.
"""
import ast
import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ddp_lesson

PACKAGE = Path(__file__).resolve().parent.parent / "ddp_lesson"
WORLDS = ddp_lesson.WORLDS
TOP = {"__init__": "rank", "__main__": "launcher"}   # the two files on top, and their worlds
# The lazy imports allowed against the direction, each in one function of one top file.
LAZY = {"__init__.py": ("load_ipython_extension", {"ddp_lesson.notebook.magics.register"})}
RANK_THIRD_PARTY = {"torch", "torchvision"}
PROCESS_WRAPPER = {"guard": {"psutil"}, "agent": {"psutil"}, "procs": {"psutil"}}


def has_python(folder):
    """A folder that holds Python files; a checkout upgraded by `git pull` may keep a folder of
    the old layout that holds only __pycache__."""
    return any(folder.rglob("*.py"))


def module_names(package=PACKAGE):
    """{module name: its worlds} of the modules in the world folders (a subpackage counts as
    one); two worlds may hold a module of the same name (rank/warm/ and launcher/warm.py):
    their paths tell them apart."""
    out = {}
    for world in WORLDS:
        for p in sorted((package / world).iterdir()):
            if p.suffix == ".py" and p.stem != "__init__" or (p / "__init__.py").exists():
                out.setdefault(p.stem, []).append(world)
    return out


MODULES = module_names()


def sources(package=PACKAGE):
    """Every source file of the package: (path, its world, whether it is a lesson script)."""
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).parts
        world = parts[0] if parts[0] in WORLDS else TOP[path.stem]
        yield path, world, parts[:2] == ("rank", "scripts")


def imports(source, package):
    """(ddp_lesson names, other top-level names) that one source file (or parsed tree) imports,
    anywhere in it (lazy imports inside functions count too). An imported name is dotted in full
    (`from ..rank import guard` in ddp_lesson.launcher: ddp_lesson.rank.guard). `package`: the
    file's own package, for relative imports."""
    ours, others = set(), set()
    for node in ast.walk(ast.parse(source) if isinstance(source, str) else source):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = parts[:len(parts) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names = [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            ours.add(name) if top == "ddp_lesson" else others.add(top)
    return ours, others


def world_named(name):
    """The world of a dotted name in ddp_lesson by its path; None for the package's own names
    (ddp_lesson, BadInput, __version__, learner_folder)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in WORLDS else None


def violations(where, world, source, package, script=False, stem=None):
    """Sentences naming each import that goes the wrong way from one source file: `world` is
    the file's world, `package` its dotted package; a lesson script (`script`) may import its
    siblings and other libraries."""
    tree = ast.parse(source)
    if str(where) in LAZY:   # the one allowed lazy import, exactly: the function is left out
        function, allowed = LAZY[str(where)]
        for node in list(tree.body):
            if isinstance(node, ast.FunctionDef) and node.name == function \
                    and imports(node, package) == (allowed, set()):
                tree.body.remove(node)
    ours, others = imports(tree, package)
    out = []
    if world == "rank" and not script:
        allowed = set(sys.stdlib_module_names) | RANK_THIRD_PARTY | PROCESS_WRAPPER.get(stem, set())
        out += [f"{where} (rank side) imports {m}, which a rank must not need" for m in sorted(others - allowed)]
    for name in sorted(ours):
        target = world_named(name)
        if world == "rank" and target in ("launcher", "notebook") or world == "launcher" and target == "notebook":
            out.append(f"{where} ({world} side) imports {name} ({target} side)")
        if target is None and len(name.split(".")) > 1 and name.split(".")[1] in MODULES:
            paths = " or ".join(f"ddp_lesson.{w}.{name.split('.', 1)[1]}" for w in MODULES[name.split(".")[1]])
            out.append(f"{where} imports {name}, which is no module: the path is {paths}")
    return out


def scan(package=PACKAGE):
    found = []
    for path, world, script in sources(package):
        dotted = ".".join(path.relative_to(package.parent).parent.parts)
        found += violations(path.relative_to(package), world, path.read_text(), dotted, script, path.stem)
    return found


def test_every_module_sits_in_a_world_folder():
    on_top = {p.name for p in PACKAGE.iterdir() if p.suffix == ".py" or p.is_dir() and has_python(p)}
    assert on_top == {"__init__.py", "__main__.py", *WORLDS}, on_top
    assert {w for worlds in MODULES.values() for w in worlds} == set(WORLDS)


def test_a_folder_left_by_git_pull_is_ignored(tmp_path):
    """A folder of the flat layout that `git pull` emptied but for __pycache__ is no module."""
    copy = tmp_path / "ddp_lesson"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "scripts" / "__pycache__").mkdir(parents=True)
    (copy / "scripts" / "__pycache__" / "train_ddp.cpython-311.pyc").write_bytes(b"")
    assert not has_python(copy / "scripts") and has_python(copy / "rank")
    assert module_names(copy) == MODULES and scan(copy) == []


def test_imports_go_one_way():
    found = scan()
    assert not found, "\n".join(found)


@pytest.mark.parametrize("world, line, what", [
    ("rank", "from ..launcher import launch", "(launcher side)"),
    ("rank", "import ddp_lesson.launcher.monitor", "(launcher side)"),
    ("rank", "from ddp_lesson.notebook.widgets import RunPanel", "(notebook side)"),
    ("rank", "import matplotlib.pyplot as plt", "matplotlib, which a rank must not need"),
    ("launcher", "from ..notebook.plots import LivePlot", "(notebook side)"),
    ("launcher", "from ddp_lesson import world", "which is no module: the path is ddp_lesson.launcher.world"),
    ("rank", "from ddp_lesson import metrics", "which is no module: the path is ddp_lesson.rank.metrics"),
])
def test_a_planted_wrong_import_is_found(world, line, what):
    """The check can fail: a wrong import, planted lazily at the end of a real module's source."""
    real = PACKAGE / world / ("metrics.py" if world == "rank" else "launch.py")
    source = real.read_text() + f"\n\ndef _planted():\n    {line}\n"
    found = violations(real.name, world, source, f"ddp_lesson.{world}", stem=real.stem)
    assert any(what in v for v in found), (line, found)
    assert not violations(real.name, world, real.read_text(), f"ddp_lesson.{world}", stem=real.stem)


def test_a_module_planted_in_a_folder_takes_its_world(tmp_path):
    """In a copy of the package, a new file's folder alone makes it rank or launcher side, and
    the whole scan names it."""
    copy = tmp_path / "ddp_lesson"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert scan(copy) == []
    (copy / "rank" / "planted_rank.py").write_text("from ..launcher import launch\n")
    (copy / "rank" / "scripts" / "old").mkdir()   # a leftover folder: no module
    (copy / "rank" / "scripts" / "old" / "__pycache__").mkdir()
    (copy / "launcher" / "planted_launcher.py").write_text("def f():\n    from ..notebook import widgets\n")
    found = scan(copy)
    assert any(f.startswith("rank/planted_rank.py (rank side) imports ddp_lesson.launcher.launch") for f in found), found
    assert any(f.startswith("launcher/planted_launcher.py (launcher side) imports ddp_lesson.notebook.widgets")
               for f in found), found
    assert len(found) == 2, found


@pytest.mark.parametrize("planted, what", [
    ("from .launcher import launch\n", "__init__.py (rank side) imports ddp_lesson.launcher.launch"),
    ("import matplotlib\n", "__init__.py (rank side) imports matplotlib"),
    ("from .notebook.magics import register\n", "__init__.py (rank side) imports ddp_lesson.notebook.magics"),
])
def test_the_package_init_is_rank_side(tmp_path, planted, what):
    """Every rank and the warm process run ddp_lesson/__init__.py: at module level it imports
    what a rank may; the lazy import inside load_ipython_extension is allowed, and nothing more."""
    copy = tmp_path / "ddp_lesson"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    init = copy / "__init__.py"
    source = init.read_text()
    init.write_text(source + "\n" + planted)
    found = scan(copy)
    assert len(found) == 1 and found[0].startswith(what), found
    # a second import inside load_ipython_extension is no longer the allowed one
    init.write_text(source.replace("    from .notebook.magics import register\n",
                                   "    from .notebook.magics import register\n    from .launcher import launch\n"))
    found = scan(copy)
    assert any(f.startswith("__init__.py (rank side) imports ddp_lesson.notebook.magics") for f in found), found


# --- one name per module ---

@pytest.mark.parametrize("world, name", sorted((w, n) for n, worlds in MODULES.items() for w in worlds))
def test_a_module_has_only_its_path_as_name(world, name):
    """`ddp_lesson.launch` is no module: every module is imported by its path only, so grep,
    tracebacks and monkeypatches see one name."""
    real = importlib.import_module(f"ddp_lesson.{world}.{name}")
    assert real.__name__ == real.__spec__.name == f"ddp_lesson.{world}.{name}"
    with pytest.raises(ImportError):
        importlib.import_module(f"ddp_lesson.{name}")
    with pytest.raises(ImportError):
        exec(f"from ddp_lesson import {name}", {})


def test_notebooks_and_tests_import_by_path():
    """What the package's scan checks, for the notebooks' cells and the tests too."""
    import json
    found = []
    root = PACKAGE.parent
    for nb in sorted((root / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
            if cell["cell_type"] != "code":
                continue
            src = "".join(cell["source"])
            code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in src.splitlines())
            try:
                ours, _ = imports(code, "ddp_lesson")
            except SyntaxError:
                continue
            found += [f"{nb.name} cell {i}: {n}" for n in ours
                      if world_named(n) is None and len(n.split(".")) > 1 and n.split(".")[1] in MODULES]
    for path in sorted((root / "tests").rglob("*.py")) + sorted((root / "bench").rglob("*.py")):
        ours, _ = imports(path.read_text(), "tests")
        found += [f"{path.name}: {n}" for n in ours
                  if world_named(n) is None and len(n.split(".")) > 1 and n.split(".")[1] in MODULES]
    assert not found, found


def module_graph(package=PACKAGE):
    """{module: the package modules it imports, lazily too}; a name imported from a module
    (`from .guard import AGENT_ENV`) counts as that module."""
    files = {".".join(p.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in package.rglob("*.py") if "scripts" not in p.parts}
    graph = {}
    for name, path in files.items():
        dotted = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        ours, _ = imports(path.read_text(), dotted)
        targets = set()
        for imported in ours:
            parts = imported.split(".")
            while parts and ".".join(parts) not in files:
                parts.pop()
            if parts and ".".join(parts) != name and len(parts) > 1:
                targets.add(".".join(parts))
        graph[name] = targets
    return graph


def circles(graph):
    """Each import circle once, as the list of modules around it."""
    found, done = [], set()

    def visit(node, path):
        if node in path:
            loop = path[path.index(node):]
            if frozenset(loop) not in done:
                done.add(frozenset(loop))
                found.append(loop)
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])

    for start in sorted(graph):
        visit(start, [])
    return found


def test_no_import_circles():
    """Modules import each other one way: a circle (agent.py and guard.py, once) means two
    modules that cannot be understood, or changed, one at a time."""
    assert circles(module_graph()) == []
    planted = {**module_graph(), "ddp_lesson.rank.rundir": {"ddp_lesson.rank.guard"}}
    assert any(set(c) == {"ddp_lesson.rank.guard", "ddp_lesson.rank.rundir"} for c in circles(planted))
