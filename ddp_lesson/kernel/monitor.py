"""Watching a run without any UI: what the command line's follow loop and the notebook's
RunPanel both show. The one view model: a Monitor reads a launch.Run's directory (its metric
rows, its logs) and judges it; views only draw what it says.

    mon = Monitor(run, output=True)
    for u in mon.updates():            # one Update per poll; the last has ended=True
        u.rows, u.state, u.text        # new metric rows; "running"/"ok"/...; the status line
        mon.rows                       # every row read so far
        u.log, u.output                # rank 0's log tail; new (rank, stream, text) chunks
        u.stragglers, u.resources      # slow ranks now; memory per rank, GPU use per device
        u.times                        # the step times they are judged on (views draw these)

`Session` holds the runs one view (a RunPanel) starts of one script: their directories, the
latest run and its Monitor, and which run a cell must check after a click on Run.

`FrameClock` says when a live plot should draw its next frame: at most 4 frames per
second, fewer when a frame is slow to draw (on a small machine the viewer shares cores
with the ranks it watches), and never more than MAX_FRAME_S apart while points arrive.
"""
import math
import time
from dataclasses import dataclass, field

from pathlib import Path

from .. import BadInput
from . import devices, failures, launch, runs, spec
from ..rank import rundir

POLL_S = 0.25          # how often a view reads new rows and logs
LOG_LINES = 15
MIN_FRAME_S = 0.25     # at most 4 frames per second
FRAME_BUDGET = 0.05    # a frame may cost this share of the time between frames
MAX_FRAME_S = 2.0      # ... but a live plot never waits longer than this
GPU_POLL_S = 2.0       # nvidia-smi takes ~50 ms: read it at most this often
TIME_WINDOW = 30       # stragglers are judged on each rank's last 30 steps


def where(config):
    """The devices of a run, in the one wording of a device plan."""
    return devices.describe(config.get("nproc"), spec.gpus(config), config.get("backend"))


def launch_text(config):
    """`warm` or `cold (why)`: how the launch started its processes (config["launch"])."""
    launch = config.get("launch") or {}
    if launch.get("mode") == "warm":
        return "warm"
    why = launch.get("why")
    return f"cold ({why})" if why else "cold"


def diverged(rows):
    """Whether the loss of a run's `rows` diverged: its last value is not finite, or over ten
    times its first, on some rank. Its processes may still have ended without an error."""
    by_rank = {}
    for r in rows:
        if r.get("loss") is not None:
            by_rank.setdefault(r.get("rank"), []).append(r["loss"])
    return any(not math.isfinite(v[-1]) or abs(v[-1]) > 10 * abs(v[0]) for v in by_rank.values() if len(v) > 1)


def title(run, rows=()):
    """`label: status, 12.3 s  (devices)`: the live plot's title; an ok run whose loss
    diverged (`rows`, its metric rows) says so instead of "ok"."""
    res = run.result
    state = res["status"] if res else "running"
    if state == "ok" and diverged(rows):
        state = "ended, but the loss diverged"
    extra = f", {res['duration_s']:.1f} s" if res and res.get("duration_s") is not None else ""
    return f"{run.config.get('label', run.run_dir.name)}: {state}{extra}  ({where(run.config)})"


def running_text(run, rows=()):
    """One line for a running run; `rows`: its metric rows read so far (a Monitor's rows)."""
    step = max((r.get("step", 0) for r in rows[-50:]), default=None)
    at = f", step {step}" if step is not None else ", starting"
    return (f"Running: {where(run.config)}, {launch_text(run.config)}{at}, {run.elapsed:.0f} s. "
            f"Run dir: {run.run_dir}")


def result_text(run, rows=()):
    """One line for an ended run: how it ended and, when ok, the last loss and accuracy of
    `rows` (its metric rows, a Monitor's rows)."""
    res = run.result
    status = res["status"]
    if status == "ok":
        bits = []
        for key, fmt in (("loss", "{:.3f}"), ("test_accuracy", "{:.1%}")):
            vals = [r[key] for r in rows if key in r]
            if vals:
                big = key == "loss" and not abs(vals[-1]) < 1e4        # 1.3e22, inf or nan
                bits.append(f"{key.replace('_', ' ')} {('{:.3g}' if big else fmt).format(vals[-1])}")
        tail = (", " + ", ".join(bits)) if bits else ""
        if diverged(rows):
            return f"Finished without an error in {res['duration_s']:.1f} s, but the loss diverged{tail}. Run dir: {run.run_dir}"
        return f"Finished ok in {res['duration_s']:.1f} s{tail}. Run dir: {run.run_dir}"
    if status == "failed":
        if res.get("failure"):
            return "Failed: " + failures.headline(res["failure"])
        return "Failed: " + res.get("message", f"see {rundir.agent_log('')} in the run directory.").splitlines()[0]
    if status == "interrupted":
        return "Interrupted: " + res.get("message", "the run was stopped.")
    if status == "timeout":
        return "Timed out: " + res.get("message", "")
    return status


@dataclass
class Update:
    rows: list                     # metric rows new since the last poll
    state: str                     # "running", or the result's status once ended
    text: str                      # the status line
    title: str = ""                # the run's title, for a plot
    log: str = ""                  # rank 0's stdout tail (with the failure's message once failed)
    output: list = field(default_factory=list)   # new (rank, stream, text) chunks, with output=True
    ended: bool = False
    stragglers: list = field(default_factory=list)  # ranks slower than the rest (runs.StepTimes' rule)
    times: object = None           # the run's runs.StepTimes so far: views draw it, never judge it
    resources: str = ""            # memory per rank; on GPUs, use and memory per device


def resources_text(times, stragglers, gpus=()):
    """One line: who is slow, each rank's memory, each GPU's use (from devices.utilisation)."""
    bits = []
    if stragglers:
        med = times.medians()
        fast = [m["wait_s"] for r, m in med.items() if r not in stragglers]
        waits = f"; the others wait {1000 * sum(fast) / len(fast):.0f} ms per step for it" if fast else ""
        bits.append(f"Straggler: rank {', '.join(map(str, stragglers))}{waits}.")
    if times.mem_mb:
        mem = ", ".join(f"rank {r} {mb:.0f} MB" for r, mb in sorted(times.mem_mb.items()))
        bits.append(f"Memory: {mem}.")
    for idx, util, used, total in gpus:
        bits.append(f"GPU {idx}: {util:.0f}% busy, {used / 1024:.1f}/{total / 1024:.0f} GiB.")
    return " ".join(bits)


class Monitor:
    """Polls one launch.Run: owns what views show of it. `rows`: every metric row read so far.
    Not thread-safe: one poller at a time."""

    def __init__(self, run, log_lines=LOG_LINES, output=False):
        self.run = run
        self.log_lines = log_lines
        self.rows = []
        self._metrics = runs.MetricsTail(run.run_dir)
        self._output = runs.LogTail(run.run_dir) if output else None
        self.times = runs.StepTimes(window=TIME_WINDOW)
        self._gpus = spec.gpus(run.config) or None  # physical indices
        self._gpu_rows, self._gpu_at = [], -GPU_POLL_S

    def _gpu_use(self, ended):
        if self._gpus is None or ended:
            return []
        if time.monotonic() - self._gpu_at >= GPU_POLL_S:
            self._gpu_rows, self._gpu_at = devices.utilisation(self._gpus), time.monotonic()
        return self._gpu_rows

    def poll(self):
        run = self.run
        ended = run.done()   # read before the files, so the last poll sees everything
        rows = self._metrics.read()
        self.rows.extend(rows)
        chunks = self._output.read() if self._output is not None else []
        log = runs.log_tail(run.run_dir, lines=self.log_lines) if self.log_lines else ""
        slow = self.times.add(rows).stragglers()
        extra = {"stragglers": slow, "times": self.times,
                 "resources": resources_text(self.times, slow, self._gpu_use(ended))}
        if not ended:
            return Update(rows, "running", running_text(run, self.rows), title(run, self.rows), log, chunks, **extra)
        if run.result["status"] == "failed":
            log = (log + "\n\n" if log else "") + run.result.get("message", "")
        return Update(rows, run.result["status"], result_text(run, self.rows), title(run, self.rows), log, chunks,
                      ended=True, **extra)

    def updates(self, interval=POLL_S, timeout=None):
        """Poll every `interval` s until the run ends (the last Update has ended=True) or
        `timeout` s pass (then the generator just stops)."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            u = self.poll()
            yield u
            if u.ended or (end is not None and time.monotonic() >= end):
                return
            self.run.wait_done(interval)


def next_run_dir(base_run_dir, runs_base, earlier, stem):
    """The run directory of a view's next run: `base_run_dir`, then base-2, base-3, ...;
    else a new one under `runs_base`; else None (the launcher's default)."""
    if base_run_dir:
        base = Path(base_run_dir)
        return base if not earlier else base.with_name(f"{base.name}-{len(earlier) + 1}")
    if runs_base:
        return rundir.new_path(base=runs_base, name=stem)
    return None


class Session:
    """The runs one view starts of one script: `runs` (their directories, oldest first),
    `last_run` and its `monitor`, `error` (the last bad input's sentence).

    A learner may press Run and then also run the cell that calls run() and wait(). The click
    is noted (`clicked`); the cell takes it (`take_click`): with the same settings (script
    text, arguments, devices) the cell checks that run and no second one starts; with other
    settings the cell waits for it to end, then starts its own. While a run that no click
    started is still going, a cell's run() is refused (`for_cell`): it may never end."""

    def __init__(self, script, label=None, run_dir=None, runs_base=None, timeout=None, extra_args=()):
        self.script, self.label, self.timeout = Path(script), label, timeout
        self.extra_args = [str(a) for a in extra_args]
        self.base_run_dir, self.runs_base = run_dir, runs_base
        self.last_run, self.runs, self.error, self.monitor = None, [], None, None
        self._click = None   # (run, settings) of a run a click started and no cell has checked yet

    def going(self):
        return self.last_run is not None and not self.last_run.done()

    def settings(self, args, selection):
        """What makes two runs the same: the script's text, its arguments, the devices."""
        try:
            text = self.script.read_bytes()
        except OSError:
            text = None
        return text, list(args) + self.extra_args, selection

    def start(self, args, selection):
        """Launch the script with `args` on `selection` (DevicePicker.selection(): launch.start's
        device keywords). Its spec.Spec is built here, so a script written after the view was
        made is found; BadInput as the Spec raises it, with `error` set to its sentence."""
        try:
            what = spec.Spec(self.script, devices.Request(**selection), args=list(args) + self.extra_args,
                             timeout=self.timeout, label=self.label)
            run_dir = next_run_dir(self.base_run_dir, self.runs_base, self.runs, what.label)
            run = launch.run(what, run_dir)
        except BadInput as e:
            self.error = str(e)
            raise
        self.error, self.last_run, self.monitor = None, run, Monitor(run)
        self.runs.append(run.run_dir)
        return run

    def clicked(self, run, settings):
        self._click = (run, settings)

    def take_click(self):
        """The (run, settings) of a click no cell has checked yet, if that run is the latest;
        else None. Either way the click is now taken."""
        click, self._click = self._click, None
        return click if click is not None and click[0] is self.last_run else None

    def for_cell(self, apply, settings, wait):
        """A cell's run(), before it starts anything: the clicked run if the cell checks it,
        None to start the cell's own, False to start nothing (apply(), which puts the cell's
        overrides in place, said they were bad); settings() and wait() are the view's. Raises
        BadInput while a run no click started is still going."""
        click = self.take_click()
        if click is None:
            if self.going():
                raise BadInput("A run started earlier is still going: wait for it (panel.wait()) "
                               "or press Stop, then run this cell again.")
            return None
        if not apply():
            return False
        run, clicked_with = click
        if clicked_with == settings() and not (run.done() and run.result["status"] == "interrupted"):
            return run
        if not run.done():
            print("The run started with the Run button has other settings than this cell's: "
                  "waiting for it to end, then starting the cell's own.", flush=True)
            wait()
        return None

    def to_wait(self):
        """The run a cell waits for; BadInput after bad input (not an earlier run's result) or
        before any run."""
        if self.last_run is None or self.error is not None:
            raise BadInput(self.error or "Nothing to wait for: press Run or call panel.run() first.")
        return self.last_run

    def follow(self, run, draw, stop, timeout=None):
        """Call draw() (one poll, drawn; True once the run ended) every POLL_S until the run
        ends, then return its result; None if still running after `timeout` s. An interrupt
        calls stop(), then propagates. A cell that followed the run checked it."""
        end = None if timeout is None else time.monotonic() + timeout
        try:
            while not draw():
                if end is not None and time.monotonic() >= end:
                    return None
                run.wait_done(POLL_S)
        except KeyboardInterrupt:
            stop()
            raise
        if self._click is not None and self._click[0] is run:
            self._click = None   # a later run() starts afresh
        return run.result

    @staticmethod
    def watch(run, draw, standing_aside, failed):
        """The loop of a thread that keeps a view up to date while nobody waits: draw() every
        POLL_S until the run ends, except while standing_aside() (wait() draws then);
        failed(error) for an exception in draw (the loop goes on)."""
        ended = False
        while not ended:
            ended = run.wait_done(POLL_S)
            if not standing_aside():
                try:
                    ended = draw()
                except Exception as e:
                    failed(e)


class FrameClock:
    """Decides when a live plot draws; `frames` and `frame_s` say what drawing cost."""

    def __init__(self):
        self.frames, self.frame_s = 0, 0.0
        self._last, self._points, self._title = 0.0, -1, None

    def due(self, points, title, final=False):
        if final:   # the last frame: unless exactly this was drawn already
            return points != self._points or title != self._title or self.frames == 0
        interval = min(MAX_FRAME_S, max(MIN_FRAME_S, self.frame_s / FRAME_BUDGET))
        return points != self._points and time.monotonic() - self._last >= interval

    def drawn(self, points, title, seconds):
        self.frames += 1
        self.frame_s = seconds
        self._last, self._points, self._title = time.monotonic(), points, title
