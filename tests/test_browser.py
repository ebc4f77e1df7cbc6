"""The course in a real JupyterLab, driven by a real (headless) Chromium.

What a learner does, end to end: open a notebook that shows the run panel, run its cells
from the Run menu, see the device picker and the panel render, press Run and watch the live
plot update until the status says ok; press Run again and Stop while it trains, and find
every process of that run gone; press Run once more and restart the kernel from the Kernel
menu while it trains, and find every process of that run gone too.

- JupyterLab runs on 127.0.0.1 on a free port, rooted in a temporary folder holding a small
  notebook made for this test (the run panel on the reference DDP script), with temporary
  Jupyter config/data/runtime/settings folders, so nothing of the user's set-up is read or
  written. Runs land in the temporary folder's runs/.
- Chromium: Playwright's sync API with the system's Chromium (`/usr/bin/chromium`, or
  `$DDP_LESSON_CHROMIUM`); Playwright's own browser download is not needed. The test
  skips, saying why, only when no Chromium or no Playwright is installed.
- Screenshots go to test-artifacts/browser/ (NN-<step>.png, and failure.png when a step
  fails), with JupyterLab's log.
- At the end JupyterLab is stopped and every process it started is ended by PID.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from ddp_lesson.launcher import launch
from ddp_lesson.rank import procs
from conftest import wait_until

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / "test-artifacts" / "browser"

CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage",
]

# Generous: the machines that run this are often shared and slow.
SERVER_START_S = 120
KERNEL_READY_S = 120
RUN_OK_S = 150
STOP_S = 60

# The notebook the learner opens: the reference DDP script written to work/train.py, as the
# lessons do, then the run panel on it (3 epochs: long enough to see the plot move).
SETUP_CELL = """\
import pathlib, shutil
import ddp_lesson
pathlib.Path("work").mkdir(exist_ok=True)
from ddp_lesson.rank.bundled import script
_ = shutil.copy(script("ddp_basic.py"), "work/train.py")
"""
PANEL_CELL = """\
from ddp_lesson.notebook.widgets import RunPanel, DevicePicker
panel = RunPanel("work/train.py", options={"epochs": 3}, picker=DevicePicker(),
                 metrics=("loss", "test_accuracy"))
panel
"""


def find_chromium():
    for candidate in (os.environ.get("DDP_LESSON_CHROMIUM"), "/usr/bin/chromium",
                      shutil.which("chromium"), shutil.which("chromium-browser"),
                      shutil.which("google-chrome")):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def make_notebook(path, sources=(SETUP_CELL, PANEL_CELL)):
    def cell(source):
        return {"cell_type": "code", "execution_count": None, "id": f"c{abs(hash(source)) % 10**8}",
                "metadata": {}, "outputs": [], "source": source.splitlines(keepends=True)}
    nb = {
        "cells": [
            {"cell_type": "markdown", "id": "intro", "metadata": {},
             "source": ["# Browser test\n", "Pick devices, press **Run**, watch the curves."]},
            *[cell(source) for source in sources],
        ],
        "metadata": {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python",
                                    "name": "python3"},
                     "language_info": {"name": "python"}},
        "nbformat": 4, "nbformat_minor": 5,
    }
    path.write_text(json.dumps(nb, indent=1))


def lab_env(home):
    """An environment for JupyterLab and its kernels: this checkout importable, every
    Jupyter folder temporary, nothing of the caller's DDP_LESSON_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDP_LESSON_", "JUPYTER"))}
    env.pop("MASTER_PORT", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    folders = {
        "JUPYTER_CONFIG_DIR": "config", "JUPYTER_DATA_DIR": "data", "JUPYTER_RUNTIME_DIR": "runtime",
        "JUPYTERLAB_SETTINGS_DIR": "lab-settings", "JUPYTERLAB_WORKSPACES_DIR": "lab-workspaces",
        "IPYTHONDIR": "ipython", "MPLCONFIGDIR": "matplotlib",
    }
    for key, name in folders.items():
        (home / name).mkdir(parents=True, exist_ok=True)
        env[key] = str(home / name)
    # No news or update checks popping up over the notebook (and no network).
    notify = home / "lab-settings" / "@jupyterlab" / "apputils-extension"
    notify.mkdir(parents=True, exist_ok=True)
    (notify / "notification.jupyterlab-settings").write_text(
        json.dumps({"checkForUpdates": False, "fetchNews": "false"}))
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Lab:
    """A JupyterLab server in its own session; `close()` ends it and all it started."""

    def __init__(self, root, home, log_path):
        self.port = launch.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "lab", "--no-browser",
             "--IdentityProvider.token=", "--ServerApp.password=", "--ServerApp.ip=127.0.0.1",
             f"--port={self.port}", "--ServerApp.port_retries=0", f"--ServerApp.root_dir={root}",
             # offline and quiet: no update checks, news or extension manager look-ups
             "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
             "--LabApp.news_url=None", "--LabApp.extension_manager=readonly",
             *(["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else [])],
            cwd=root, env=lab_env(home), stdin=subprocess.DEVNULL, stdout=self.log,
            stderr=subprocess.STDOUT, start_new_session=True)
        self.seen = {}  # pid -> psutil.Process: everything of the server's tree we saw

    def remember(self):
        for p in procs.tree(self.proc.pid):
            self.seen.setdefault(p.pid, p)

    def wait_ready(self, timeout):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/status", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"JupyterLab did not answer within {timeout} s; see {self.log.name}")

    def close(self):
        self.remember()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the server shuts its kernels down
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        left = [p for p in self.seen.values() if procs.alive(p)]
        procs.kill_all(left)
        procs.wait_gone(left, timeout=10)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.log.close()


class Shots:
    def __init__(self, page, folder):
        self.page, self.folder, self.n = page, folder, 0

    def __call__(self, name):
        self.n += 1
        return self.save(f"{self.n:02d}-{name}")

    def save(self, name):
        path = self.folder / f"{name}.png"
        try:
            self.page.screenshot(path=str(path), full_page=True)
        except Exception:  # a screenshot must never hide the real failure
            pass
        return path


def poll(predicate, timeout, interval=0.25, what="condition"):
    value = wait_until(predicate, timeout, interval)
    if not value:
        raise AssertionError(f"timed out after {timeout} s waiting for {what}")
    return value


@pytest.fixture(scope="module")
def chromium_path():
    path = find_chromium()
    if path is None:
        pytest.skip("no Chromium found (install Debian's `chromium`, or set DDP_LESSON_CHROMIUM "
                    "to a Chromium/Chrome executable); the browser test needs one")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("the Python package `playwright` is not installed (pip install playwright)")
    return path


@pytest.fixture(scope="module")
def lab(tmp_path_factory, chromium_path):
    # one JupyterLab server and one browser for both tests: each start costs CPU seconds
    tmp_path = tmp_path_factory.mktemp("lab")
    root = tmp_path / "course"
    root.mkdir()
    make_notebook(root / "panel.ipynb")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for old in ARTIFACTS.glob("*.png"):
        old.unlink()
    server = Lab(root, tmp_path / "jupyter-home", ARTIFACTS / "jupyterlab.log")
    server.root = root
    try:
        server.wait_ready(SERVER_START_S)
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def browser(lab, chromium_path):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path, headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 1000})   # a fresh tab's state per test
    try:
        page = context.new_page()
        page.set_default_timeout(60_000)
        yield page
    finally:
        context.close()


def run_dirs(root):
    runs = root / "runs"
    return sorted(p for p in runs.iterdir() if p.is_dir()) if runs.is_dir() else []


def cell_errors(page):
    """Tracebacks shown in the notebook's outputs (a cell that raised)."""
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    return [t for t in errors.all_inner_texts() if "Traceback" in t or "Error" in t]


def wait_for(page, locator, timeout, what):
    """Wait for `locator` to be visible; fail at once, with the traceback, if a cell raised."""
    end = time.monotonic() + timeout
    while True:
        try:
            locator.first.wait_for(state="visible", timeout=1000)
            return locator.first
        except Exception:
            pass
        errors = cell_errors(page)
        assert not errors, f"a cell raised while waiting for {what}:\n" + "\n".join(errors)[-3000:]
        if time.monotonic() >= end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def shoot_on_failure(drive_fn, lab, page, name):
    """drive_fn(lab, page, shot); on any failure the page is saved as `name` first."""
    shot = Shots(page, ARTIFACTS)
    try:
        drive_fn(lab, page, shot)
    except BaseException:
        shot.save(name)
        raise


@pytest.mark.timeout(600)
def test_run_panel_in_jupyterlab(lab, page):
    shoot_on_failure(drive, lab, page, "failure")


def drive(lab, page, shot):
    page.goto(f"{lab.url}/lab/workspaces/panel/tree/panel.ipynb")   # its own workspace: no other tab
    wait_for(page, page.locator(".jp-NotebookPanel .jp-Cell").nth(2), KERNEL_READY_S, "the notebook")
    wait_for(page, page.locator("#jp-main-statusbar", has_text="Idle"), KERNEL_READY_S,
             "the kernel to start")
    shot("notebook-open")

    # Run all cells from the Run menu, as a learner would.
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-item[data-command='runmenu:run-all']").click()

    panel = page.locator(".jp-Cell").nth(2).locator(".jp-OutputArea-output")
    buttons = panel.locator("button.jupyter-widgets.widget-button")
    run_button = buttons.filter(has_text="Run").first
    stop_button = buttons.filter(has_text="Stop").first
    wait_for(page, run_button, KERNEL_READY_S, "the run panel's Run button")
    wait_for(page, stop_button, 30, "the run panel's Stop button")
    assert panel.locator(".jupyter-widgets").count() > 3, "the device picker and the panel should render"
    text = panel.first.inner_text()
    assert "epochs" in text, f"the panel should show its option widgets; it shows: {text!r}"
    assert re.search(r"GPU|CPU processes", text), f"the device picker should render; the panel shows: {text!r}"
    plot = panel.locator("img").first
    shot("panel-rendered")

    def plot_src():
        try:
            return plot.get_attribute("src", timeout=1000) if plot.count() else None
        except Exception:
            return None

    def status_is(word):
        """The panel's status line (an HTML widget) starts with `word`: ok, interrupted ..."""
        try:
            texts = panel.locator(".widget-html").all_inner_texts()
        except Exception:
            return False
        return any(re.match(rf"\s*{word}\b", t) for t in texts)

    # --- first run: to the end, the plot updating while it goes ---
    before = set(run_dirs(lab.root))
    run_button.click()
    first = poll(lambda: [d for d in run_dirs(lab.root) if d not in before], 60,
                 what="the run directory of the first run")[0]
    sources = [plot_src()]

    def progress():
        lab.remember()
        src = plot_src()
        if src and src != sources[-1]:
            sources.append(src)
            if len(sources) == 3:
                shot("first-run-plot-updating")
        return (first / "result.json").exists()

    poll(progress, RUN_OK_S, interval=0.1, what="the first run to finish")
    live_frames = len([src for src in sources if src])
    result = json.loads((first / "result.json").read_text())
    assert result["status"] == "ok", result
    poll(lambda: status_is("ok"), 30, what="the status line to say ok")
    progress()
    shot("first-run-ok")
    assert live_frames >= 2, \
        f"the live plot should update at least twice while the run trains; it showed {live_frames} frame(s)"

    # --- second run: Stop while it trains; every process of it must end ---
    before = set(run_dirs(lab.root))
    run_button.click()
    second = poll(lambda: [d for d in run_dirs(lab.root) if d not in before], 60,
                  what="the run directory of the second run")[0]
    # Stop once the ranks train (metrics written), so Stop meets the whole process tree.
    poll(lambda: any(p.stat().st_size for p in (second / "metrics").glob("rank*.jsonl")), 90,
         what="the second run to start training")
    running = procs.run_processes(second)
    assert running, "the second run should have live processes before Stop"
    pids = sorted(p.pid for p in running)
    shot("second-run-training")
    stop_button.click()
    poll(lambda: (second / "result.json").exists(), STOP_S, what="the second run to end after Stop")
    result = json.loads((second / "result.json").read_text())
    assert result["status"] == "interrupted", result
    procs.wait_gone(running, timeout=10)
    assert not [p.pid for p in running if procs.alive(p)], f"processes of the stopped run still alive (of {pids})"
    assert not procs.run_processes(second), "processes of the stopped run are still alive"
    poll(lambda: status_is("interrupted"), 30, what="the status line to say interrupted")
    shot("second-run-stopped")
    assert not cell_errors(page)

    # --- third run: restart the kernel while it trains; nothing of the run may survive ---
    before = set(run_dirs(lab.root))
    run_button.click()
    third = poll(lambda: [d for d in run_dirs(lab.root) if d not in before], 60,
                 what="the run directory of the third run")[0]
    poll(lambda: procs.run_processes(third), 60, what="the third run's processes")
    poll(lambda: any(p.stat().st_size for p in (third / "metrics").glob("rank*.jsonl")), 90,
         what="the third run to start training")
    running = procs.run_processes(third)
    pids = sorted(p.pid for p in running)
    page.locator(".lm-MenuBar-itemLabel", has_text="Kernel").first.click()
    page.locator(".lm-Menu-item[data-command='kernelmenu:restart']").click()
    page.locator(".jp-Dialog .jp-Dialog-button.jp-mod-accept").click()
    procs.wait_gone(running, timeout=30)
    assert not [p.pid for p in running if procs.alive(p)], \
        f"processes of a run outlived the kernel restart (of {pids})"
    assert not procs.run_processes(third), "processes of a run outlived the kernel restart"
    wait_for(page, page.locator("#jp-main-statusbar", has_text="Idle"), KERNEL_READY_S,
             "the kernel to come back")
    shot("third-run-kernel-restarted")


# -- the live world: a %%ranks cell in JupyterLab -------------------------------------------
WORLD_RANKS = 2
WORLD_CELLS = (
    "%load_ext ddp_lesson",
    f"%ranks start -n {WORLD_RANKS} --cpu",
    "%%ranks\nimport time\nfor i in range(8):\n    print(f'tick {i} from rank {rank}', flush=True)\n"
    "    time.sleep(0.5)",
    "%%ranks\n1 / (rank - (world_size - 1))",
)


@pytest.mark.timeout(600)
def test_ranks_cell_in_jupyterlab(lab, page):
    """Run all: the world starts with its status panel; a %%ranks cell's lines stream in
    while it runs, one column per rank side by side; a rank that raises shows its
    traceback in red; the panel's Stop ends every process of the world."""
    make_notebook(lab.root / "ranks.ipynb", WORLD_CELLS)
    shoot_on_failure(drive_world, lab, page, "world-failure")


def drive_world(lab, page, shot):
    n = WORLD_RANKS
    page.goto(f"{lab.url}/lab/workspaces/world/tree/ranks.ipynb")   # its own workspace: no other tab
    wait_for(page, page.locator(".jp-NotebookPanel .jp-Cell").nth(4), KERNEL_READY_S, "the notebook")
    wait_for(page, page.locator("#jp-main-statusbar", has_text="Idle"), KERNEL_READY_S,
             "the kernel to start")
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-item[data-command='runmenu:run-all']").click()

    status = page.locator(".jp-Cell").nth(2).locator(".jp-OutputArea-output")
    stop_button = status.locator("button.jupyter-widgets.widget-button").filter(has_text="Stop").first
    wait_for(page, stop_button, KERNEL_READY_S + 120, "the world's status panel and its Stop button")
    world_dir = poll(lambda: [d for d in run_dirs(lab.root) if "world" in d.name], 30,
                     what="the world's run directory")[0]
    ranks = procs.run_processes(world_dir)
    assert ranks, "the world should have live processes once its panel shows"
    shot("world-started")

    # the streaming cell: early lines show while later ones are still to come
    out = page.locator(".jp-Cell").nth(3).locator(".jp-OutputArea-output")

    def text():
        try:
            return " ".join(out.all_inner_texts())
        except Exception:
            return ""

    seen = poll(lambda: (t := text()) and "tick 1 from rank 0" in t and t, 120, interval=0.1,
                what="the first lines of the %%ranks cell")
    assert "tick 7" not in seen, "the lines should show while the cell runs, not all at its end"
    shot("world-streaming")
    poll(lambda: all(f"tick 7 from rank {r}" in text() for r in range(n)), 60,
         what="every rank's last line")
    columns = out.locator("div[style*='border-left']")
    assert columns.count() == n, f"one column per rank: found {columns.count()}"
    boxes = [columns.nth(r).bounding_box() for r in range(n)]
    assert all(abs(b["y"] - boxes[0]["y"]) < 5 for b in boxes), f"columns not side by side: {boxes}"
    assert all(boxes[r]["x"] < boxes[r + 1]["x"] for r in range(n - 1)), boxes
    for r in range(n):
        col = columns.nth(r).inner_text()
        assert f"rank {r}" in col and f"tick 0 from rank {r}" in col and f"tick 7 from rank {r}" in col
        assert all(f"from rank {o}" not in col for o in range(n) if o != r), col
    shot("world-side-by-side")

    # the failing cell: the last rank's traceback in red, the others' value as usual
    failing = page.locator(".jp-Cell").nth(4).locator(".jp-OutputArea-output")
    error = failing.locator("pre", has_text="ZeroDivisionError").first
    poll(lambda: error.count() and error.is_visible(), 60, what="the failing rank's traceback")
    color = error.evaluate("e => getComputedStyle(e).color")
    assert color == "rgb(207, 34, 46)", f"the traceback should be red, it is {color}"
    assert "raised an exception" in " ".join(failing.all_inner_texts())
    shot("world-error-red")

    # Stop: every process of the world ends, and the panel says so
    stop_button.click()
    procs.wait_gone(ranks, timeout=STOP_S)
    assert not [p.pid for p in ranks if procs.alive(p)], "processes of the world outlived Stop"
    assert not procs.run_processes(world_dir), "processes of the world are still alive after Stop"
    poll(lambda: "stopped" in " ".join(status.locator(".widget-html").all_inner_texts()), 30,
         what="the status panel to say stopped")
    shot("world-stopped")
