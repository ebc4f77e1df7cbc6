"""The three worlds of the package, and which way imports may go.

- rank side: runs inside torchrun's processes (the agent's and ranks' guard, what lesson
  scripts and a live world's ranks import). Standard library and torch only (psutil for the
  guard and procs, which end process trees), and only other rank-side modules: a rank must
  never pay for, or depend on, the kernel's supervision or the notebook's drawing.
- kernel side: starts, supervises and reads back runs (a notebook kernel or the CLI).
  It may import the rank side (names, metric vocabulary), never the notebook side.
- notebook side: draws and teaches (widgets, plots, diagrams, lesson helpers). It may
  import both others.
Every module must be in exactly one world, so a new module is placed on purpose.
"""
import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ddp_lesson"

# __init__ is imported by every process, so at import time it defines names only; the
# magics it loads for `%load_ext ddp_lesson` make it notebook side.
RANK = {"bundled", "chain", "costmodel", "data", "dist", "forked_rank", "guard", "knobs", "metrics",
        "models", "procs", "rundir", "syncbn", "warm_server", "world_messages", "world_rank"}
KERNEL = {"__main__", "checks", "devices", "doctor", "failures", "interrupts", "launch",
          "monitor", "multinode", "runs", "scaling", "slurm", "spec", "stacks", "warm", "world"}
NOTEBOOK = {"__init__", "capstone", "diagrams", "exercises", "lesson", "magics", "plots", "simulate", "widgets"}
RANK_THIRD_PARTY = {"torch", "torchvision"}
PROCESS_WRAPPER = {"guard": {"psutil"}, "procs": {"psutil"}}


def modules():
    """{name: [source files]}: top-level modules, and a subpackage as one module."""
    out = {p.stem: [p] for p in PACKAGE.glob("*.py")}
    for d in PACKAGE.iterdir():
        if (d / "__init__.py").exists():
            out[d.name] = sorted(d.rglob("*.py"))
    return out


MODULES = modules()


def imports(source, package="ddp_lesson"):
    """(package modules, other top-level names) that one source file imports, anywhere in it
    (lazy imports inside functions count too). `package`: the file's own package, for
    relative imports."""
    ours, others = set(), set()

    def add(full, names=()):
        parts = full.split(".")
        if parts[0] != "ddp_lesson":
            others.add(parts[0])
        elif len(parts) > 1:
            ours.add(parts[1])
        else:  # from ddp_lesson import x, y: x and y are modules (or names like BadInput)
            ours.update(names)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                full = ".".join(base + ([node.module] if node.module else []))
            else:
                full = node.module
            add(full, [a.name for a in node.names])
    return ours, others


def violations(name, sources):
    """Sentences naming each import that goes the wrong way from module `name`."""
    out = []
    for src in sources:
        package = (".".join(src.relative_to(PACKAGE.parent).parent.parts)
                   if src.is_relative_to(PACKAGE) else "ddp_lesson")   # a planted copy
        ours, others = imports(src.read_text(), package)
        ours = {m for m in ours if m in MODULES and m != name}
        if name in RANK:
            allowed = set(sys.stdlib_module_names) | RANK_THIRD_PARTY | PROCESS_WRAPPER.get(name, set())
            out += [f"{src.name} (rank side) imports {m}, which a rank must not need"
                    for m in sorted(others - allowed)]
            out += [f"{src.name} (rank side) imports ddp_lesson.{m} ({'kernel' if m in KERNEL else 'notebook'} side)"
                    for m in sorted(ours - RANK)]
        elif name in KERNEL:
            out += [f"{src.name} (kernel side) imports ddp_lesson.{m} (notebook side)"
                    for m in sorted(ours & NOTEBOOK)]
    return out


def test_every_module_is_in_exactly_one_world():
    assert not (RANK & KERNEL or RANK & NOTEBOOK or KERNEL & NOTEBOOK)
    assert set(MODULES) == RANK | KERNEL | NOTEBOOK, set(MODULES) ^ (RANK | KERNEL | NOTEBOOK)


def test_imports_go_one_way():
    found = [v for name, sources in MODULES.items() for v in violations(name, sources)]
    assert not found, "\n".join(found)


def test_a_planted_wrong_import_is_found(tmp_path, monkeypatch):
    """The check can fail: a rank-side module that imports the launcher, or matplotlib, and a
    kernel-side one that imports the widgets, are each named."""
    for name, line, what in (("metrics", "from . import launch", "kernel side"),
                             ("models", "import matplotlib.pyplot as plt", "matplotlib"),
                             ("syncbn", "from ddp_lesson.widgets import RunPanel", "notebook side"),
                             ("launch", "from .plots import LivePlot", "notebook side")):
        planted = tmp_path / f"{name}.py"
        planted.write_text((PACKAGE / f"{name}.py").read_text() + f"\n\ndef _planted():\n    {line}\n")
        found = violations(name, [planted])
        assert any(what in v for v in found), (name, line, found)
