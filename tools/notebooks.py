"""The one way to keep the notebooks in shape. Prose and ordinary code cells: the .ipynb files
are the source (edit them in JupyterLab or an editor). `%%writefile work/<name>.py` cells: the
script of that name in ddp_lesson/rank/scripts/<role>/ is the source (edit it, then `sync` writes the
cell; `ddp_lesson.rank.bundled.script(name)` finds it, whatever its role folder). Then

    python tools/notebooks.py check   # every notebooks/*.ipynb; non-zero exit naming notebook and cell
    python tools/notebooks.py sync    # rewrite %%writefile cells from the shipped scripts, strip outputs

What `check` asks of every notebook: no stored outputs or execution counts; every cell has an
id, unique in its notebook (nbformat 4.5); every `%%writefile work/<name>.py` cell writes
exactly the shipped script <name>.py (which must exist); no cell touches sys.path (what a
notebook needs is in the installed package).
"""
import argparse
import json
import re
import sys
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))      # this checkout's package, not another installed copy
from ddp_lesson.rank import bundled    # noqa: E402

NOTEBOOKS = REPO / "notebooks"
ID_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")   # nbformat 4.5's rule for cell ids
WRITEFILE_RE = re.compile(r"^%%writefile\s+work/(\S+)\s*$")


def source(cell):
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def writefile_target(cell):
    """The shipped script <name> for a `%%writefile work/<name>` code cell (a FileNotFoundError
    saying why where there is none), else None."""
    if cell.get("cell_type") != "code":
        return None
    m = WRITEFILE_RE.match(source(cell).partition("\n")[0])
    if not m:
        return None
    try:
        return bundled.script(m.group(1))
    except FileNotFoundError as e:
        return e


def problems(path):
    """Sentences naming what is wrong with one notebook ([] when nothing is)."""
    name = Path(path).name
    try:
        nb = json.loads(Path(path).read_text())
    except ValueError as e:
        return [f"{name}: not valid JSON ({e})"]
    out = []
    if (nb.get("nbformat"), nb.get("nbformat_minor", 0)) < (4, 5):
        out.append(f"{name}: nbformat {nb.get('nbformat')}.{nb.get('nbformat_minor')} has no cell ids "
                   f"(4.5 or later needed; `sync` upgrades it)")
    seen = set()
    for i, cell in enumerate(nb.get("cells", [])):
        where = f"{name} cell {i} (id {cell.get('id')})"
        cid = cell.get("id")
        if cid is None or not ID_RE.match(str(cid)):
            out.append(f"{where}: missing or malformed cell id")
        elif cid in seen:
            out.append(f"{where}: the cell id is used twice")
        seen.add(cid)
        if cell.get("cell_type") != "code":
            continue
        if cell.get("outputs"):
            out.append(f"{where}: stored outputs")
        if cell.get("execution_count") is not None:
            out.append(f"{where}: stored execution count")
        text = source(cell)
        if "sys.path" in text:
            out.append(f"{where}: touches sys.path (import what it needs from the package)")
        first = text.partition("\n")[0]
        if first.startswith("%%writefile") and not WRITEFILE_RE.match(first):
            out.append(f"{where}: %%writefile must write work/<name>.py, got {first!r}")
        target = writefile_target(cell)
        if target is None:
            continue
        if isinstance(target, FileNotFoundError):
            out.append(f"{where}: writes {first.split()[-1]} but no such script is shipped: {target}")
        elif text.partition("\n")[2].rstrip("\n") != target.read_text().rstrip("\n"):
            out.append(f"{where}: differs from {target.relative_to(REPO)} (run `python tools/notebooks.py sync`)")
    return out


def check(paths):
    found = [p for path in paths for p in problems(path)]
    for line in found:
        print(line)
    print(f"{len(paths)} notebook(s) checked: " + (f"{len(found)} problem(s)" if found else "all clean"))
    return 1 if found else 0


def sync(paths):
    """Rewrite %%writefile cells from the scripts, strip outputs and counts, give cells that
    have none an id. Writes a notebook only when something changed."""
    import nbformat

    for path in paths:
        text = Path(path).read_text()
        nb = nbformat.reads(text, as_version=4)
        nb.nbformat_minor = max(nb.nbformat_minor, 5)
        used = {c.get("id") for c in nb.cells}
        for cell in nb.cells:
            if not cell.get("id"):
                cell["id"] = next(i for i in iter(lambda: uuid.uuid4().hex[:8], None) if i not in used)
                used.add(cell["id"])
            if cell.cell_type != "code":
                continue
            cell.outputs, cell.execution_count = [], None
            target = writefile_target(cell)
            if isinstance(target, Path):
                first, _, body = source(cell).partition("\n")
                if body.rstrip("\n") != target.read_text().rstrip("\n"):
                    cell.source = first + "\n" + target.read_text().rstrip("\n")
        new = nbformat.writes(nb) + "\n"
        if new != text:
            Path(path).write_text(new)
            print("synced", Path(path).name)
    return check(paths)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("command", choices=["check", "sync"])
    p.add_argument("notebooks", nargs="*", type=Path, help="default: every notebooks/*.ipynb")
    a = p.parse_args(argv)
    paths = a.notebooks or sorted(NOTEBOOKS.glob("*.ipynb"))
    return check(paths) if a.command == "check" else sync(paths)


if __name__ == "__main__":
    sys.exit(main())
