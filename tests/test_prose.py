"""The lesson text of 00-05 stays readable (issue 31): at most 10 sentences over 35 words in
all of them together, and no parentheses inside parentheses, outside fold-away <details> cells
(tools/prose.py measures; it is what a learner reads on the main thread)."""
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("prose", REPO / "tools" / "prose.py")
prose = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prose)

FIRST_LESSONS = sorted(p for p in (REPO / "notebooks").glob("0[0-5]*.ipynb"))


def test_the_measure_sees_long_sentences_and_nesting_and_skips_fine_print():
    long_one = "This sentence " + "goes on and on " * 10 + "until it ends."
    text = prose.lesson_text(f"A short one. {long_one} Then (a remark (nested) here).\n\n| a | b (c (d)) |")
    assert [len(s.split()) for s in prose.sentences(text)] == [3, 45, 5]
    assert [s.strip() for s in prose.nested_parentheses(text)] == ["(a remark (nested) here)."]
    assert prose.lesson_text("<details><summary>Under the hood: x</summary>\n\n" + long_one) == ""
    assert prose.nested_parentheses(prose.lesson_text("see `f(g(x))` and [a](http://x/(y))")) == []


def test_lessons_00_to_05_have_few_long_sentences_and_no_nested_parentheses():
    assert len(FIRST_LESSONS) >= 7, FIRST_LESSONS
    long, nested = [], []
    for path in FIRST_LESSONS:
        lg, ns = prose.measure(path)
        long += [(path.name, i, s[:100]) for i, s in lg]
        nested += [(path.name, i, s[:100]) for i, s in ns]
    assert not nested, nested
    assert len(long) <= 10, "\n".join(map(str, long))


ALL_LESSONS = sorted((REPO / "notebooks").glob("[0-9]*.ipynb"))


def markdown_cells(path):
    import json
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown"]


def test_every_fold_opens_its_cell_so_jupyterlab_folds_it():
    """JupyterLab folds a <details> only when it opens the cell and a blank line follows the
    summary (jupyterlab/jupyterlab#7527); one opened mid-paragraph shows all its fine print."""
    bad = []
    for path in ALL_LESSONS:
        for text in markdown_cells(path):
            if "<details>" not in text:
                continue
            if not (text.startswith("<details><summary>") and "</summary>\n\n" in text
                    and text.rstrip().endswith("</details>") and text.count("<details>") == 1):
                bad.append((path.name, text[:80]))
    assert not bad, bad


def test_every_notebook_links_the_glossary_near_its_top():
    missing = [p.name for p in ALL_LESSONS
               if not any("(../docs/glossary.md)" in t for t in markdown_cells(p)[:2])]
    assert not missing, missing


LATER_LESSONS = sorted(p for p in (REPO / "notebooks").glob("*.ipynb") if p.name[:2] in ("09", "10", "11"))


def test_lessons_09_to_11_each_have_few_long_sentences_and_no_nested_parentheses():
    """Issue 44: each of 09, 10 and 11 at most 10 sentences over 35 words, none nested."""
    assert len(LATER_LESSONS) == 3, LATER_LESSONS
    for path in LATER_LESSONS:
        long, nested = prose.measure(path)
        assert not nested, (path.name, [s[:100] for _, s in nested])
        assert len(long) <= 10, f"{path.name}: {len(long)} sentences over 35 words:\n" + "\n".join(s[:100] for _, s in long)


def test_the_measure_reads_markdown_files_by_section(tmp_path):
    """README.md and docs/*.md are measured too: a section stands for a cell, named by its line;
    a '#' inside a code block starts no section, and the block's text is not prose."""
    long_one = " ".join(["word"] * 40) + "."
    doc = tmp_path / "doc.md"
    doc.write_text(f"# Title\n\nShort.\n\n```bash\n# a comment (in (code))\n{long_one}\n```\n\n"
                   f"## Second\n\nA sentence (with (nesting)). {long_one}\n")
    long, nested = prose.measure(doc)
    assert [where for where, _ in long] == ["line 10"], long
    assert [where for where, _ in nested] == ["line 10"], nested
