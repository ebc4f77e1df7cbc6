"""Measure a notebook's lesson text, the markdown a learner reads outside fold-away cells:
sentences over 35 words and parentheses inside parentheses.

    python tools/prose.py notebooks/0[0-5]*.ipynb     # one line per long sentence, then totals
    python tools/prose.py README.md docs/*.md         # a markdown file: its sections stand for cells

Left out of the lesson text: `<details>` cells (fine print a learner may skip), code blocks,
inline code, tables, link targets and HTML tags. tests/test_prose.py holds 00-05 to the limits.
"""
import json
import re
import sys
from pathlib import Path

LONG = 35  # words


def lesson_text(cell_source):
    """The prose of one markdown cell, '' for a <details> cell."""
    if cell_source.lstrip().startswith("<details>"):
        return ""
    text = re.sub(r"```.*?```", " ", cell_source, flags=re.S)
    text = re.sub(r"^[ \t]*>[ \t]?", "", text, flags=re.M)        # a blockquote's text is lesson text
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("|"))
    text = re.sub(r"`[^`]*`", "CODE", text)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)      # [text](target) -> text
    text = re.sub(r"<[^>]+>", " ", text)
    return text


def sentences(text):
    """Sentences: split at . ! ? (or one that closes a bold span) followed by a space and a capital or a line break, and at
    paragraph breaks and list items."""
    out = []
    for block in re.split(r"\n\s*\n|\n\s*[-*]\s+|\n\s*\d+\.\s+|\n#+\s", text):
        block = " ".join(block.split())
        out += [s for s in re.split(r"(?<=[.!?])(?:\*\*|_)?\s+(?=[A-Z*\"'(])", block) if s.strip()]
    return out


def nested_parentheses(text):
    """The stretches of text where a '(' opens inside another."""
    found, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
            if depth == 1:
                start = i
            elif depth == 2:
                found.append(text[start:start + 120])
        elif ch == ")" and depth:
            depth -= 1
    return found


def markdown_cells(path):
    """(where, markdown) pieces of a file: a notebook's markdown cells by index, a .md file's
    sections (split before each heading outside code blocks) by their first line's number."""
    if Path(path).suffix == ".md":
        pieces, start, fenced = [[]], [1], False
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            fenced ^= line.lstrip().startswith("```")
            if line.startswith("#") and not fenced and pieces[-1]:
                pieces.append([])
                start.append(n)
            pieces[-1].append(line)
        return [(f"line {n}", "\n".join(p)) for n, p in zip(start, pieces)]
    nb = json.loads(Path(path).read_text())
    return [(f"cell {i}", "".join(c["source"])) for i, c in enumerate(nb["cells"]) if c["cell_type"] == "markdown"]


def measure(path):
    """(long sentences, nested parentheses) of one notebook or .md file: lists of (where, text),
    where is "cell N" or "line N"."""
    long, nested = [], []
    for i, source in markdown_cells(path):
        text = lesson_text(source)
        long += [(i, s) for s in sentences(text) if len(s.split()) > LONG]
        nested += [(i, s) for s in nested_parentheses(text)]
    return long, nested


def main(paths):
    total_long = total_nested = 0
    for path in paths:
        long, nested = measure(path)
        for i, s in long:
            print(f"{Path(path).name} {i}: {len(s.split())} words: {s[:160]}")
        for i, s in nested:
            print(f"{Path(path).name} {i}: nested parentheses: {s[:160]}")
        print(f"{Path(path).name}: {len(long)} sentences over {LONG} words, {len(nested)} nested parentheses")
        total_long += len(long)
        total_nested += len(nested)
    print(f"total: {total_long} sentences over {LONG} words, {total_nested} nested parentheses")
    return total_long, total_nested


if __name__ == "__main__":
    main(sys.argv[1:])
