"""What differs between Python versions (README: "Python 3.10-3.13"; tools/python_versions.sh
runs a quick subset on each interpreter it finds).

- A launcher started through an interpreter path holding `..` (`../venv/bin/python -m pytest`)
  launches warm: its sys.executable is the path as given, the warm process's (started with it)
  CPython's normalized one, and the fingerprint they compare hashes both resolved.
- pyproject's requires-python and the README state the same versions.
"""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, child_env

LAUNCHER = """
import json, sys
from ddp_lesson.launcher import launch
run = launch.start(sys.argv[1], nproc=1, cpu=True, timeout=120)
result = run.wait()
print(json.dumps({"executable": sys.executable, "launch": run.config["launch"], "status": result["status"]}))
"""


@pytest.mark.timeout(240)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="warm launches need Linux")
def test_a_launcher_started_through_a_path_with_dotdot_launches_warm(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    here = tmp_path / "cwd"
    here.mkdir()
    python = os.path.relpath(sys.executable, here)   # ../../.../bin/python, run from `here`
    assert ".." in python.split(os.sep)
    env = child_env()
    env.pop("DDP_LESSON_COLD", None)
    out = subprocess.run([python, "-c", textwrap.dedent(LAUNCHER), str(script)], cwd=here, env=env,
                         capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert ".." in seen["executable"].split(os.sep), seen   # the path as given, not normalized
    assert seen["status"] == "ok", seen
    assert seen["launch"]["mode"] == "warm" and seen["launch"]["why"] is None, seen


def test_the_readme_and_pyproject_state_the_same_pythons():
    pyproject = (REPO / "pyproject.toml").read_text()
    floor = re.search(r'requires-python = ">=3\.(\d+)"', pyproject)
    assert floor, "pyproject.toml states requires-python"
    readme = (REPO / "README.md").read_text()
    stated = re.search(r"Python 3\.(\d+)-3\.(\d+)", readme)
    assert stated, "the README states the Python versions that pass as 3.X-3.Y"
    assert int(stated.group(1)) == int(floor.group(1)), (stated.group(0), floor.group(0))
    assert "tools/python_versions.sh" in readme   # the check that keeps it true (it reads this range)
    assert 'README.md' in (REPO / "tools" / "python_versions.sh").read_text()
