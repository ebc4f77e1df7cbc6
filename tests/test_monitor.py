"""The UI-free monitor over real runs (pure-Python ranks, no torch: they start fast), and the
frame clock that throttles live plots."""
import time
from pathlib import Path
from types import SimpleNamespace

from ddp_lesson.launcher import launch, monitor, runs
from ddp_lesson.notebook import panel_state

STEPS = """
import os
from ddp_lesson.rank import metrics
rank = int(os.environ["RANK"])
for step in range(1, 4):
    metrics.log(step, loss=1.0 / step)
    print(f"rank {rank} step {step}", flush=True)
if rank == 0 and os.environ.get("FAIL"):
    raise RuntimeError("boom from rank 0")
"""


def test_updates_until_the_end_with_every_row_and_all_output(tmp_path, write_script):
    run = launch.start(write_script("steps.py", STEPS), cpu=True, run_dir=tmp_path / "run", timeout=120)
    world = run.config["world_size"]
    mon = monitor.Monitor(run, output=True)
    updates = list(mon.updates(interval=0.05))
    assert all(not u.ended and u.state == "running" for u in updates[:-1])
    last = updates[-1]
    assert last.ended and last.state == "ok" and last.text.startswith("Finished ok"), last.text
    assert "loss 0.333" in last.text                       # the last loss, in the status line
    assert sum(len(u.rows) for u in updates) == 3 * world    # every row once
    # the monitor keeps them: the run's directory holds no row it missed
    order = lambda r: (r["rank"], r["step"])   # noqa: E731
    assert sorted(mon.rows, key=order) == sorted(runs.load(run.run_dir).rows, key=order)
    out = "".join(text for u in updates for rank, stream, text in u.output if stream == "stdout")
    assert all(f"rank {r} step 3" in out for r in range(world))
    assert "rank 0 step 3" in last.log                      # rank 0's tail


def test_a_failed_run_ends_with_its_root_cause(tmp_path, write_script):
    run = launch.start(write_script("fails.py", STEPS), cpu=True, run_dir=tmp_path / "run",
                       env={"FAIL": 1}, timeout=120)
    *_, last = monitor.Monitor(run).updates(interval=0.05)
    assert last.state == "failed" and last.text.startswith("Failed:"), last.text
    assert "boom from rank 0" in last.log


def test_updates_stop_at_the_timeout_while_the_run_goes_on(tmp_path, write_script):
    run = launch.start(write_script("sleeps.py", "import time; time.sleep(60)"), cpu=True,
                       run_dir=tmp_path / "run", timeout=120)
    try:
        t = time.monotonic()
        updates = list(monitor.Monitor(run).updates(interval=0.05, timeout=0.5))
        assert time.monotonic() - t < 10 and not updates[-1].ended
        assert updates[-1].text.startswith("Running:")
    finally:
        run.stop()


def test_the_status_lines_read_the_rows_they_are_given():
    """A view's status line reads its monitor's rows: the run handle keeps none."""
    run = SimpleNamespace(config={"nproc": 2, "backend": "gloo"}, elapsed=3.0, run_dir=Path("r"),
                          result={"status": "ok", "duration_s": 3.0})
    assert ", step 7, " in monitor.running_text(run, [{"step": 5}, {"step": 7}, {"rank": 0}])
    assert ", starting, " in monitor.running_text(run)
    done = monitor.result_text(run, [{"loss": 0.5}, {"loss": 0.25}, {"test_accuracy": 0.9}])
    assert done.startswith("Finished ok in 3.0 s, loss 0.250, test accuracy 90.0%."), done


def test_frame_clock_throttles_and_always_draws_a_changed_final_frame():
    clock = panel_state.FrameClock()
    assert clock.due(5, "t")                   # nothing drawn yet
    clock.drawn(5, "t", seconds=0.001)
    assert not clock.due(5, "t")               # nothing new
    assert not clock.due(9, "t")               # new points, but too soon after the last frame
    time.sleep(panel_state.MIN_FRAME_S)
    assert clock.due(9, "t")
    assert not clock.due(5, "t", final=True)   # the final frame is what was drawn
    assert clock.due(5, "t: ok", final=True)   # ... but not with the ended title
    slow = panel_state.FrameClock()
    slow.drawn(1, "t", seconds=1.0)            # a slow frame: the next waits longer
    time.sleep(panel_state.MIN_FRAME_S)
    assert not slow.due(2, "t")
