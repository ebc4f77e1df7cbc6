"""tools/gpu_check.sh refuses a machine without a usable GPU: non-zero exit, one sentence,
nothing written. (Its GPU path runs on GPU machines only; no CPU test depends on it.)"""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tools" / "gpu_check.sh"
RESULTS = REPO / "docs" / "gpu-results.md"


def has_gpu():
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    out = subprocess.run([smi, "-L"], capture_output=True, text=True)
    return out.returncode == 0 and "GPU" in out.stdout


def run_check(env):
    before = RESULTS.stat().st_mtime_ns if RESULTS.exists() else None
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120)
    after = RESULTS.stat().st_mtime_ns if RESULTS.exists() else None
    assert before == after, "gpu_check wrote docs/gpu-results.md on a machine it refused"
    return out


def test_refuses_a_machine_without_gpus():
    if has_gpu():
        pytest.skip("this machine has a GPU: bash tools/gpu_check.sh runs for real here")
    out = run_check(dict(os.environ))
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "no NVIDIA GPU" in lines[0] and lines[0].endswith("."), out.stderr


def test_refuses_gpus_that_torch_cannot_use(tmp_path):
    """nvidia-smi lists a GPU but this torch cannot use it (CPU-only build, driver mismatch)."""
    try:
        import torch
        if torch.cuda.is_available():
            pytest.skip("torch can use a GPU here")
    except ImportError:
        pass
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: Imaginary GPU (UUID: GPU-0)'\n")
    (fake / "nvidia-smi").chmod(0o755)
    env = dict(os.environ, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}")
    out = run_check(env)
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "torch.cuda.is_available() is False" in lines[0], out.stderr
