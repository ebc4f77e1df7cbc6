"""Notebooks 06-08: each has asserts and an exercise with a checker and a solution.
(Outputs, ids, %%writefile cells: test_notebooks_check.)"""
import json
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = ["06_scaling_and_performance", "07_troubleshooting", "08_multi_node"]
SCRIPTS = REPO / "ddp_lesson" / "scripts"


def cells(name):
    return json.loads((REPO / "notebooks" / f"{name}.ipynb").read_text())["cells"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_checked_with_an_exercise(name):
    code = [c for c in cells(name) if c["cell_type"] == "code"]
    text = "\n".join("".join(c["source"]) for c in code)
    assert text.count("assert ") >= 8
    assert "# solution" in text and "check_" in text          # exercise, checker, solution
    assert "clear_output" not in text


# The failure scripts' behaviour is asserted where it is taught, not launched again here:
# hang.py timing out (and starting although 29500 is taken): notebook 07 section 1 (and, via the
# command line, test_cli.py::test_rank_that_never_joins_the_collective_times_out); resume.py's
# root cause (rank 1, not rank 0's teardown) and its elastic resume from the checkpoint
# ((epoch, attempt, resumed_from) rows): notebook 07 section 4, with the same arguments.
