"""The three worlds of the package, and which way imports may go.

A module's world is its folder:
- ddp_lesson/rank/: runs inside torchrun's processes (the agent's and ranks' guard, what lesson
  scripts and a live world's ranks import, and rank/scripts/, what the ranks run). Standard
  library and torch only (psutil for the guard and procs, which end process trees), and only
  other rank-side modules: a rank must never pay for, or depend on, the kernel's supervision
  or the notebook's drawing.
- ddp_lesson/kernel/: starts, supervises and reads back runs (a notebook kernel or the CLI).
  It may import the rank side (names, metric vocabulary), never the notebook side.
- ddp_lesson/notebook/: draws and teaches (widgets, plots, diagrams, lesson helpers). It may
  import both others.
Two files stay on top: __init__ (every process imports it, a rank and the warm process included,
so it is rank side; the one exception is `%load_ext ddp_lesson`, whose function imports the
notebook side's magics when called) and __main__ (the command line, kernel side). Package modules import each other by the real path,
so the layout shows; notebooks, lesson scripts and users keep the short names
(`from ddp_lesson import launch`), which name the same module objects.
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
TOP = {"__init__": "rank", "__main__": "kernel"}   # the two files on top, and their worlds
# The lazy imports allowed against the direction, each in one function of one top file.
LAZY = {"__init__.py": ("load_ipython_extension", {"ddp_lesson.notebook.magics.register"})}
RANK_THIRD_PARTY = {"torch", "torchvision"}
PROCESS_WRAPPER = {"guard": {"psutil"}, "agent": {"psutil"}, "procs": {"psutil"}}
# The modules of the flat layout before the worlds became folders: these names must keep working
# (dist.py, used only by a test script, moved to tests/scripts/).
OLD_NAMES = ("bundled", "capstone", "chain", "checks", "costmodel", "data", "devices", "diagrams",
             "doctor", "exercises", "failures", "guard", "interrupts", "knobs",
             "launch", "lesson", "magics", "metrics", "models", "monitor", "multinode", "plots",
             "procs", "rundir", "runs", "scaling", "simulate", "slurm", "stacks", "syncbn", "warm",
             "widgets", "world", "world_messages", "world_rank")


def has_python(folder):
    """A folder that holds Python files; a checkout upgraded by `git pull` may keep a folder of
    the old layout that holds only __pycache__."""
    return any(folder.rglob("*.py"))


def short_names(package=PACKAGE):
    """{short name: world} of the modules in the world folders (a subpackage counts as one)."""
    out = {}
    for world in WORLDS:
        for p in sorted((package / world).iterdir()):
            if world == "rank" and p.name == "warm":   # ddp_lesson.rank.warm: real path only (kernel's warm has the short name)
                continue
            if p.suffix == ".py" and p.stem != "__init__" or (p / "__init__.py").exists():
                assert p.stem not in out, f"{p.stem} is in {out[p.stem]}/ and {world}/"
                out[p.stem] = world
    return out


SHORT = short_names()


def sources(package=PACKAGE):
    """Every source file of the package: (path, its world, whether it is a lesson script)."""
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).parts
        world = parts[0] if parts[0] in WORLDS else TOP[path.stem]
        yield path, world, parts[:2] == ("rank", "scripts")


def imports(source, package):
    """(ddp_lesson names, other top-level names) that one source file (or parsed tree) imports,
    anywhere in it (lazy imports inside functions count too). An imported name is dotted in full
    (`from ..rank import guard` in ddp_lesson.kernel: ddp_lesson.rank.guard). `package`: the
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
    """The world of a dotted name in ddp_lesson, by its real path or its short name; None for
    the package's own names (ddp_lesson, BadInput, __version__)."""
    parts = name.split(".")
    if len(parts) < 2:
        return None
    return parts[1] if parts[1] in WORLDS else SHORT.get(parts[1])


def violations(where, world, source, package, script=False, stem=None):
    """Sentences naming each import that goes the wrong way from one source file: `world` is
    the file's world, `package` its dotted package; a lesson script (`script`) may use the
    short names and import its siblings and other libraries."""
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
        if world == "rank" and target in ("kernel", "notebook") or world == "kernel" and target == "notebook":
            out.append(f"{where} ({world} side) imports {name} ({target} side)")
        if not script and world_named(name) and name.split(".")[1] in SHORT:
            out.append(f"{where} imports {name} by its short name; the package imports by the real path")
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
    assert set(SHORT.values()) == set(WORLDS)


def test_a_folder_left_by_git_pull_is_ignored(tmp_path):
    """A folder of the flat layout that `git pull` emptied but for __pycache__ is no module."""
    copy = tmp_path / "ddp_lesson"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "scripts" / "__pycache__").mkdir(parents=True)
    (copy / "scripts" / "__pycache__" / "train_ddp.cpython-311.pyc").write_bytes(b"")
    assert not has_python(copy / "scripts") and has_python(copy / "rank")
    assert short_names(copy) == SHORT and scan(copy) == []


def test_imports_go_one_way():
    found = scan()
    assert not found, "\n".join(found)


@pytest.mark.parametrize("world, line, what", [
    ("rank", "from ..kernel import launch", "(kernel side)"),
    ("rank", "import ddp_lesson.kernel.monitor", "(kernel side)"),
    ("rank", "from ddp_lesson import launch", "(kernel side)"),             # a short name is followed
    ("rank", "from ddp_lesson.widgets import RunPanel", "(notebook side)"),
    ("rank", "import matplotlib.pyplot as plt", "matplotlib, which a rank must not need"),
    ("kernel", "from ..notebook.plots import LivePlot", "(notebook side)"),
    ("kernel", "from ddp_lesson import diagrams", "(notebook side)"),
    ("kernel", "from ddp_lesson import world", "by its short name"),   # the right world, the wrong name
])
def test_a_planted_wrong_import_is_found(world, line, what):
    """The check can fail: a wrong import, planted lazily at the end of a real module's source."""
    real = PACKAGE / world / ("metrics.py" if world == "rank" else "launch.py")
    source = real.read_text() + f"\n\ndef _planted():\n    {line}\n"
    found = violations(real.name, world, source, f"ddp_lesson.{world}", stem=real.stem)
    assert any(what in v for v in found), (line, found)
    assert not violations(real.name, world, real.read_text(), f"ddp_lesson.{world}", stem=real.stem)


def test_a_module_planted_in_a_folder_takes_its_world(tmp_path):
    """In a copy of the package, a new file's folder alone makes it rank or kernel side, and
    the whole scan names it."""
    copy = tmp_path / "ddp_lesson"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert scan(copy) == []
    (copy / "rank" / "planted_rank.py").write_text("from ..kernel import launch\n")
    (copy / "rank" / "scripts" / "old").mkdir()   # a leftover folder: no module
    (copy / "rank" / "scripts" / "old" / "__pycache__").mkdir()
    (copy / "kernel" / "planted_kernel.py").write_text("def f():\n    from ..notebook import widgets\n")
    found = scan(copy)
    assert any(f.startswith("rank/planted_rank.py (rank side) imports ddp_lesson.kernel.launch") for f in found), found
    assert any(f.startswith("kernel/planted_kernel.py (kernel side) imports ddp_lesson.notebook.widgets")
               for f in found), found
    assert len(found) == 2, found


@pytest.mark.parametrize("planted, what", [
    ("from .kernel import launch\n", "__init__.py (rank side) imports ddp_lesson.kernel.launch"),
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
                                   "    from .notebook.magics import register\n    from .kernel import launch\n"))
    found = scan(copy)
    assert any(f.startswith("__init__.py (rank side) imports ddp_lesson.notebook.magics") for f in found), found


# --- the short names: `from ddp_lesson import launch` is ddp_lesson.kernel.launch ---

def test_every_old_name_is_the_real_module():
    assert set(OLD_NAMES) <= set(SHORT), set(OLD_NAMES) - set(SHORT)
    for name in OLD_NAMES:
        if name == "forked_rank":   # a rank's entry file: importing it runs the guard
            continue
        real = importlib.import_module(f"ddp_lesson.{SHORT[name]}.{name}")
        assert importlib.import_module(f"ddp_lesson.{name}") is real, name
        assert sys.modules[f"ddp_lesson.{name}"] is real and getattr(ddp_lesson, name) is real, name
        assert real.__name__ == real.__spec__.name == f"ddp_lesson.{SHORT[name]}.{name}"
    from ddp_lesson.diagrams.shapes import DEVICE_COLOURS
    from ddp_lesson.notebook.diagrams import shapes
    assert DEVICE_COLOURS is shapes.DEVICE_COLOURS
    assert importlib.import_module("ddp_lesson.diagrams.shapes") is shapes


def test_the_short_name_table_is_the_folders():
    assert ddp_lesson._SHORT == SHORT


def test_python_m_runs_a_module_by_its_short_name(tmp_path):
    """`python -m ddp_lesson.guard SCRIPT` (the command an older run's config.json records) runs
    the real guard as __main__, which runs SCRIPT; the short name's spec names the real file."""
    script = tmp_path / "hello.py"
    script.write_text("import sys\nprint('hello from', sys.argv[1:])\n")
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    env.pop("RANK", None)
    done = subprocess.run([sys.executable, "-m", "ddp_lesson.guard", str(script), "x"], env=env,
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout == "hello from ['x']\n", done
    done = subprocess.run([sys.executable, "-m", "ddp_lesson.guard"], env=env,
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 1 and "usage: python -m ddp_lesson.rank.guard" in done.stderr, done
    spec = ddp_lesson._ShortNames().find_spec("ddp_lesson.guard")   # not the cached module's spec
    assert spec.origin == str(PACKAGE / "rank" / "guard.py") and spec.name == "ddp_lesson.guard"


def test_a_monkeypatch_through_the_short_name_patches_the_real_module(monkeypatch):
    from ddp_lesson.kernel import launch
    monkeypatch.setattr("ddp_lesson.launch.STOP_GRACE_S", 0.25)
    assert launch.STOP_GRACE_S == 0.25


@pytest.mark.parametrize("name", ["ddp_lesson.nothing", "ddp_lesson.kernel.nothing",
                                  "ddp_lesson.launch.nothing", "ddp_lesson.notebook.nothing"])
def test_an_unknown_name_still_raises(name):
    with pytest.raises(ImportError):
        importlib.import_module(name)
    with pytest.raises(ImportError):
        exec(f"from ddp_lesson import {name.split('.')[-1]}", {})
