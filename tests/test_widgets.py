"""The device picker and the run panel, driven like a learner would (values, .click()),
with real torchrun runs on 2 CPU ranks, and once headless in a kernel via nbclient."""

import threading

import ipywidgets as W
import pytest

from ddp_lesson import BadInput
from ddp_lesson.launcher import monitor, runs
from ddp_lesson.rank import procs
from ddp_lesson.notebook import widgets
from ddp_lesson.rank.bundled import script
from ddp_lesson.launcher.devices import GPU
from ddp_lesson.notebook.widgets import DevicePicker, RunPanel, option_args

from conftest import REPO, wait_until

TRAIN = script("ddp_syncbn.py")  # the reference loop with --sync-bn
OPTIONS = {"epochs": 1, "batch-size": 64, "lr": 0.05, "sync-bn": False}

# Pure Python ranks (no torch import, so they start fast): log a metric row and a line
# of output every 50 ms, until stopped.
LOOP = """
import os, time
from ddp_lesson.rank import metrics
rank = int(os.environ["RANK"])
for step in range(1, 100000):
    metrics.log(step, loss=1.0 / step)
    if rank == 0:
        print(f"step {step}", flush=True)
    time.sleep(0.05)
"""

FAILING = """
import os, time
from ddp_lesson.rank import metrics
rank = int(os.environ["RANK"])
metrics.log(1, loss=1.0)
if rank == 1:
    time.sleep(0.5)
    raise RuntimeError("boom from rank 1")
print("rank 0 waits for rank 1", flush=True)
time.sleep(60)
"""


# -- device picker ----------------------------------------------------------------------
@pytest.mark.parametrize("nproc", ["8", "3"])
def test_picker_default_equals_plan_with_ddp_lesson_nproc(monkeypatch, nproc):
    # DDP_LESSON_NPROC=8 on a 2-core machine: plan() and %ranks start allow it
    # (validate.max_cpu_ranks), so the picker must start at the same count, not cap it lower
    from ddp_lesson.launcher import devices
    monkeypatch.setenv("DDP_LESSON_NPROC", nproc)
    monkeypatch.delenv("DDP_LESSON_MAX_CPU_RANKS", raising=False)
    monkeypatch.setattr(devices, "cpu_count", lambda: 2)
    want = devices.plan(available=[])
    picker = DevicePicker(gpus=[])
    assert picker.selection() == {"nproc": want.nproc} and want.nproc == int(nproc)
    assert devices.Request(**picker.selection()).plan(available=[]).nproc == want.nproc


def test_picker_without_gpus_asks_for_cpu_processes():
    picker = DevicePicker(gpus=[])
    assert picker.selection() == {"nproc": 2}
    assert picker.nproc.max >= 4
    picker.nproc.value = 3
    assert picker.selection() == {"nproc": 3}
    note = picker.widget.children[0].children[1]
    assert "CPU processes" in note.value and "gloo" in note.value


def test_picker_with_gpus_skips_busy_ones_and_offers_cpu():
    gpus = [GPU(0, "A100", 81920, 10), GPU(1, "A100", 81920, 30000, processes=[(123, 30000)]),
            GPU(2, "A100", 81920, 10)]
    picker = DevicePicker(gpus=gpus)
    assert [b.description for b in picker.boxes][1].endswith("in use by 1 process(es)")
    assert picker.selection() == {"gpus": [0, 2]}  # the busy GPU starts unticked
    picker.boxes[1].value = True
    picker.boxes[2].value = False
    assert picker.selection() == {"gpus": [0, 1]}
    picker.use_cpu.value = True
    assert picker.selection() == {"cpu": True, "nproc": 2}
    assert all(b.disabled for b in picker.boxes)
    picker.disabled = True
    picker.disabled = False
    assert all(b.disabled for b in picker.boxes)  # still CPU mode


def test_one_gpu_starts_on_cpu_processes_and_says_why(monkeypatch):
    monkeypatch.delenv("DDP_LESSON_NPROC", raising=False)
    monkeypatch.setattr(widgets.devices, "cpu_count", lambda: 8)
    picker = DevicePicker(gpus=[GPU(0, "RTX 4090", 24564, 10)])
    assert picker.selection() == {"cpu": True, "nproc": 2}
    assert picker.boxes[0].disabled and picker.cpu_row.layout.display == ""
    note = picker.widget.children[-1].value
    assert "One GPU" in note and "2 ranks" in note and "untick" in note
    picker.use_cpu.value = False
    assert picker.selection() == {"gpus": [0]}
    assert not picker.boxes[0].disabled
    # two GPUs keep the GPU default
    assert DevicePicker(gpus=[GPU(0, "A", 1, 0), GPU(1, "A", 1, 0)]).selection() == {"gpus": [0, 1]}


@pytest.mark.parametrize("n_gpus", [1, 2, 3])
def test_picker_default_follows_the_one_device_policy(n_gpus, monkeypatch):
    """The picker starts on CPU processes exactly where devices.default_gpus gives none, the
    policy plan(), `%ranks start` and the command line share (tests/test_devices.py)."""
    monkeypatch.delenv("DDP_LESSON_NPROC", raising=False)
    gpus = [GPU(i, "A", 1, 0) for i in range(n_gpus)]
    sel = DevicePicker(gpus=gpus).selection()
    assert ("cpu" in sel) == (widgets.devices.default_gpus(gpus) == [])
    assert widgets.devices.Request(**sel).plan(available=gpus).gpus == widgets.devices.default_gpus(gpus)


@pytest.mark.parametrize("busy", [[0], [1], [0, 1], [1, 2], []])
def test_picker_default_with_busy_gpus_is_the_plan(busy, monkeypatch):
    """Busy GPUs: the picker's default is exactly what plan() gives with nothing asked, the
    free GPUs when there are two or more of them, else CPU processes (devices.default_gpus)."""
    monkeypatch.delenv("DDP_LESSON_NPROC", raising=False)
    monkeypatch.setattr(widgets.devices, "cpu_count", lambda: 8)
    gpus = [GPU(i, "T4", 15360, 9000 if i in busy else 0, processes=[(1, 9000)] if i in busy else [])
            for i in range(3 if max(busy, default=0) >= 2 else 2)]
    picker = DevicePicker(gpus=gpus)
    default = widgets.devices.plan(available=gpus)
    want = {"gpus": default.gpus} if default.gpus else {"cpu": True, "nproc": default.nproc}
    assert picker.selection() == want
    free = [g.index for g in gpus if not g.busy]
    assert default.gpus == (free if len(free) >= 2 else [])
    if not default.gpus:   # unticking CPU offers the free GPUs, or all of them if none is free
        picker.use_cpu.value = False
        assert picker.selection() == {"gpus": free or [g.index for g in gpus]}
        assert "Fewer than two free GPUs" in picker.widget.children[-1].value


# -- options ----------------------------------------------------------------------------
def test_options_get_widgets_of_their_type_and_become_arguments(tmp_path):
    panel = RunPanel(TRAIN, options=OPTIONS, picker=DevicePicker(gpus=[]), runs_base=tmp_path)
    kinds = {name: type(w) for name, w in panel.inputs.items()}
    assert kinds == {"epochs": W.IntText, "batch-size": W.IntText, "lr": W.FloatText,
                     "sync-bn": W.Checkbox}
    assert option_args(panel.values()) == ["--epochs", "1", "--batch-size", "64", "--lr", "0.05"]
    panel.inputs["sync-bn"].value = True
    assert option_args(panel.values())[-1] == "--sync-bn"
    assert option_args({"name": "x", "off": None}) == ["--name", "x"]


def test_bad_input_shows_one_sentence_and_starts_nothing(tmp_path):
    base = tmp_path / "runs"
    panel = RunPanel(tmp_path / "missing.py", options=OPTIONS, picker=DevicePicker(gpus=[]),
                     runs_base=base)
    panel.run_button.click()
    assert panel.status == "bad input"
    assert "missing.py does not exist" in panel.status_text
    assert panel.last_run is None and panel.runs == [] and not base.exists()
    with pytest.raises(BadInput, match="does not exist"):
        panel.wait()

    panel = RunPanel(TRAIN, options=OPTIONS, picker=DevicePicker(gpus=[]), runs_base=base)
    assert panel.run(epoch=3) is None
    assert "no option 'epoch'" in panel.status_text
    assert panel.run(batch_size=0.5) is None  # a whole-number box
    assert "batch-size" in panel.status_text
    assert panel.last_run is None and not base.exists()


# -- real runs ----------------------------------------------------------------------------
@pytest.fixture
def shown(monkeypatch):
    """Record what the panel sends to the notebook: display() and update_display()."""
    sent = {"display": [], "update": []}
    monkeypatch.setattr(widgets, "display", lambda obj, **kw: sent["display"].append((obj, kw)))
    monkeypatch.setattr(widgets, "update_display", lambda obj, **kw: sent["update"].append((obj, kw)))
    return sent


def test_run_button_trains_to_completion_and_the_plot_follows(tmp_path, shown, monkeypatch):
    # the monitor is the one judge of stragglers: once per poll, never again by a frame
    judged, polls = [], []
    real_judge, real_poll = runs.StepTimes.stragglers, monitor.Monitor.poll
    monkeypatch.setattr(runs.StepTimes, "stragglers", lambda self, *a: judged.append(1) or real_judge(self, *a))
    monkeypatch.setattr(monitor.Monitor, "poll", lambda self: polls.append(real_poll(self)) or polls[-1])
    panel = RunPanel(TRAIN, options=OPTIONS, picker=DevicePicker(gpus=[]), runs_base=tmp_path,
                     label="panel-ok")
    panel._ipython_display_()
    (_, first), = [d for d in shown["display"] if d[1].get("display_id")]
    display_id = first["display_id"]
    # nobody calls wait(): the click path must keep the panel up to date by itself
    panel.run_button.click()
    assert panel.status == "running"
    assert panel.run_button.disabled and not panel.stop_button.disabled
    assert wait_until(lambda: panel.status != "running", timeout=150), panel.status_text
    assert panel.status == "ok", panel.status_text + "\n" + panel.log_text
    assert panel.status_text.startswith("Finished ok")
    assert not panel.run_button.disabled and panel.stop_button.disabled
    assert panel.result["status"] == "ok"
    assert panel.runs == [panel.run_dir] and panel.run_dir.parent == tmp_path
    assert "test accuracy" in panel.log_text  # rank 0's stdout tail
    # the plot: updates of the one display, the last one the final static figure
    assert shown["update"] and all(kw == {"display_id": display_id} for _, kw in shown["update"])
    assert panel.frames == len(shown["update"])
    final = shown["update"][-1][0]
    assert final.data == panel.png and panel.png[:4] == b"\x89PNG"
    assert "panel-ok: ok" in panel.plot.live.title
    plotted = [r for r in panel.rows for m in panel.plot.live.metrics if m in r]
    assert panel.plot.live.points() == len(plotted) > 10   # every value of a plotted metric
    assert panel.frames >= 1 and len(judged) == len(polls) >= panel.frames, (len(judged), len(polls))
    assert any(u.times.per_rank for u in polls)   # the lesson script's rows had step times to judge


def test_stop_and_interrupt_end_every_process(tmp_path, write_script, monkeypatch):
    script = write_script("loop.py", LOOP)
    panel = RunPanel(script, options={}, picker=DevicePicker(gpus=[]), runs_base=tmp_path)

    # Interrupt (the notebook's stop button) while wait() runs: the run is stopped first.
    # It lands while torchrun is still starting its workers, the hardest moment to clean up.
    run = panel.run()
    real_wait = run.wait_done
    def wait_done(*a, **kw):  # Ctrl-C lands while wait() waits between polls, once
        if threading.current_thread() is not threading.main_thread():
            return real_wait(*a, **kw)   # the panel's own polling thread
        monkeypatch.setattr(run, "wait_done", real_wait)
        raise KeyboardInterrupt
    monkeypatch.setattr(run, "wait_done", wait_done)
    with pytest.raises(KeyboardInterrupt):
        panel.wait()
    assert panel.status == "interrupted", panel.status_text
    assert procs.run_processes(run.run_dir) == []

    # the Stop button, on a second run from the same panel
    run2 = panel.run()
    assert run2 is not None and run2.run_dir != run.run_dir
    assert wait_until(lambda: "step" in panel.log_text, timeout=60), panel.log_text
    with pytest.raises(BadInput, match="still going"):   # a cell's run() while a run goes
        panel.run()
    panel.run_button.click()                             # the button: refused on the status line
    assert "already going" in panel.status_text and panel.last_run is run2
    panel.stop_button.click()
    assert wait_until(lambda: panel.status == "interrupted", timeout=60), panel.status_text
    assert panel.status_text.startswith("Interrupted")
    assert procs.run_processes(run2.run_dir) == []
    assert run2.result["status"] == "interrupted"
    assert not panel.run_button.disabled
    assert panel.runs == [run.run_dir, run2.run_dir]


def test_failing_rank_traceback_reaches_the_panel(tmp_path, write_script):
    script = write_script("fails.py", FAILING)
    panel = RunPanel(script, options={}, picker=DevicePicker(gpus=[]), runs_base=tmp_path)
    panel.run()
    result = panel.wait(timeout=120)
    assert result is not None and result["status"] == "failed"
    assert result["failure"]["rank"] == 1
    assert panel.status == "failed"
    assert "rank 1" in panel.status_text and "boom from rank 1" in panel.status_text
    assert "Traceback" in panel.log_text and "RuntimeError: boom from rank 1" in panel.log_text
    assert "rank 0 waits for rank 1" in panel.log_text  # rank 0's stdout tail, too


def test_the_cell_after_a_click_checks_that_run_or_waits_for_it(tmp_path, write_script, capsys):
    """A learner presses Run, then runs the next cell too (panel.run(); panel.wait(); checks).
    With other settings than the click's, the cell waits for the clicked run to end, then
    starts its own; with the same settings it checks the clicked run, without a second run.
    A second click while the first run goes (refused) keeps the record of the first; and a
    run still going that no click started is waited for too: run() never hands the cell None
    while another run goes."""
    script = write_script("short.py", SHORT)      # SHORT: below, a rank that logs --steps rows
    panel = RunPanel(script, options={"steps": 60}, picker=DevicePicker(gpus=[]), runs_base=tmp_path)
    panel.run_button.click()                      # 60 steps of 50 ms: still going below
    first = panel.last_run
    panel.run_button.click()                      # a second click: refused, the first one stands
    assert panel.last_run is first and "already going" in panel.status_text
    own = panel.run(steps=5)                      # the cell asks for other settings
    assert own is not None and own is not first, "the cell must not wait on a run with other settings"
    assert first.done() and first.result["status"] == "ok"   # it waited for the learner's run ...
    assert "waiting for it to end" in capsys.readouterr().out
    assert own.config["args"] == ["--steps", "5"]            # ... then started its own

    with pytest.raises(BadInput, match="still going"):   # own still going, no click: a clear error,
        panel.run(steps=3)                                # not None and a wait() on `own`
    assert panel.last_run is own
    assert panel.wait(timeout=120)["status"] == "ok"

    panel.run_button.click()                      # the widgets now hold the cell's settings
    clicked = panel.last_run
    assert panel.run(steps=5) is clicked          # same settings: the cell checks the clicked run
    assert panel.wait(timeout=120)["status"] == "ok"
    assert panel.runs == [first.run_dir, own.run_dir, clicked.run_dir]   # three runs

    assert panel.run(steps=0.5) is None           # bad input after a run: wait() must not
    with pytest.raises(BadInput, match="steps"):  # hand back the earlier run's result
        panel.wait()


# -- in a real kernel (nbclient) ------------------------------------------------------------
SHORT = """
import argparse, time
from ddp_lesson.rank import metrics
p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=30)
for step in range(1, p.parse_args().steps + 1):
    metrics.log(step, loss=1.0 / step)
    time.sleep(0.05)
"""


def test_notebook_keeps_one_plot_output_headless_and_after_a_click(tmp_path, write_script):
    """panel.wait() (the headless path) and a Run click with nobody waiting (the thread
    path) both update ONE plot output in place, in a real kernel."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    short = write_script("short.py", SHORT)
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "from ddp_lesson.notebook.widgets import RunPanel\n"
            f"panel = RunPanel({str(short)!r}, options={{'steps': 60}}, runs_base={str(tmp_path)!r})\n"
            "panel"),
        nbformat.v4.new_code_cell(
            "run = panel.run()\n"
            "result = panel.wait()\n"
            "assert result['status'] == 'ok', panel.status_text\n"
            "print('frames', panel.frames)"),
        nbformat.v4.new_code_cell(
            "import time\n"
            f"clicked = RunPanel({str(short)!r}, options={{'steps': 40}}, runs_base={str(tmp_path)!r})\n"
            "display(clicked)\n"
            "clicked.run_button.click()\n"
            "end = time.monotonic() + 90\n"
            "while clicked.status == 'running' and time.monotonic() < end:\n"
            "    time.sleep(0.2)  # the kernel is busy here: only the panel's thread can draw\n"
            "assert clicked.status == 'ok', clicked.status_text\n"
            "time.sleep(0.5)\n"
            "print('frames', clicked.frames)"),
    ]
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                     resources={"metadata": {"path": str(REPO)}})
    client.execute()
    panel_cell, wait_cell, click_cell = nb.cells
    widget, plot = ["application/vnd.jupyter.widget-view+json", "text/plain"], ["image/png", "text/plain"]
    kinds = [sorted(o.get("data", {})) for o in panel_cell.outputs]
    assert kinds == [widget, plot], kinds  # one plot, however many frames
    frames = int(wait_cell.outputs[-1]["text"].split()[-1])
    assert frames >= 2  # so the one output really was updated in place
    assert not any("image/png" in o.get("data", {}) for o in wait_cell.outputs)
    kinds = [sorted(o.get("data", {})) for o in click_cell.outputs if o["output_type"] == "display_data"]
    assert kinds == [widget, plot], kinds  # the placeholder became the final figure
    assert int(click_cell.outputs[-1]["text"].split()[-1]) >= 1
