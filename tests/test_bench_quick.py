"""Every benchmark that takes --quick runs to the end as a subprocess and prints ratios.
Found by glob, so benches added later are covered too. A smoke test, not a measurement:
where a bench has a size flag the test takes its smallest run (SMALLEST); the figures
come from running the benches themselves (bench/README.md)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MINE = {"allreduce_bandwidth.py", "scaling.py", "ddp_knobs.py"}
# lines a bench must print, beyond "ratio:" (the live world's bench runs here only, not twice)
EXPECT = {"world_roundtrip.py": ("ratio: world start / script launch",
                                 "ratio: script launch / cell round trip")}
# a bench's smallest run: every line of it still runs, on less data or fewer ranks (a rank
# costs ~5 CPU-s before any work: import torch, and DDP(...) imports torch._dynamo)
SMALLEST = {"scaling.py": ("--samples", "1024"),   # 16 steps at 1 rank, 8 a rank at 2
            "world_roundtrip.py": ("--nproc", "1"),
            "launcher_overhead.py": ("--nproc", "1"),   # both launches at 1 rank
            "panel_overhead.py": ("--nproc", "1"),      # both runs (A and B) at 1 rank
            "ddp_knobs.py": ("--nproc", "1"),
            "ddp_speedup.py": ("--global-batch", "128")}   # 64 a rank
BENCHES = sorted(p for p in (REPO / "bench").glob("*.py")   # a bench runs as a script; common.py is shared code
                 if "--quick" in p.read_text() and '__name__ == "__main__"' in p.read_text())


def test_found_mine():
    names = {p.name for p in BENCHES}
    assert MINE <= names


def run_bench(bench, tmp_path, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDP_LESSON_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["DDP_LESSON_RUNS"] = str(tmp_path / "runs")  # run directories go to the test's temp folder
    out = subprocess.run([sys.executable, str(bench), "--quick", *args], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=280)   # under pytest-timeout's 300 s
    assert out.returncode == 0, f"{bench.name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.mark.parametrize("bench", BENCHES, ids=[p.stem for p in BENCHES])
def test_quick(bench, tmp_path):
    out = run_bench(bench, tmp_path, *SMALLEST.get(bench.name, ()))
    assert out.stdout.strip(), "the bench printed nothing"
    if bench.name in MINE:
        assert "ratio:" in out.stdout, out.stdout
    for line in EXPECT.get(bench.name, ()):
        assert line in out.stdout, out.stdout


def test_step_timer_overhead_quick(tmp_path):
    """--timing: three copies of ddp_basic.py's step in one launch; both ratios printed.
    One rank: the bench's every line runs; StepTimer's hook at 3 ranks is test_timing's."""
    # 18 steps (3 a round) after 2 warm-up turns a round: enough to see real step times, not
    # to measure the 2% goal (the bench does that, 1500 steps after 10 warm-up turns)
    out = run_bench(REPO / "bench" / "panel_overhead.py", tmp_path, "--timing", "--steps", "18",
                    "--warmup", "2", "--nproc", "1").stdout
    ratios = {}
    for line in out.splitlines():
        for key in ("(A2 vs A): ", "(B vs A and A2): "):
            if key in line:
                ratios[key] = float(line.split(key)[1].split()[0])
    assert len(ratios) == 2, out
    assert all(0.3 < r < 3 for r in ratios.values()), out   # real step times, not zeros or junk
    assert "18 steps" in out and "on gloo" in out, out
