"""What one RunPanel holds beyond its drawing, so the panel only draws:

- `PanelState`: the runs the panel starts of one script (their directories, the latest run and
  its Monitor) and which run a cell must check after a click on Run;
- `FrameClock`: when a live plot draws its next frame: at most 4 frames per second, fewer when
  a frame is slow to draw (on a small machine the viewer shares cores with the ranks it
  watches), and never more than MAX_FRAME_S apart while points arrive.
"""
import time
from pathlib import Path

from .. import BadInput
from ..launcher import devices, launch, monitor, spec
from ..rank import rundir

MIN_FRAME_S = 0.25     # at most 4 frames per second
FRAME_BUDGET = 0.05    # a frame may cost this share of the time between frames
MAX_FRAME_S = 2.0      # ... but a live plot never waits longer than this


def next_run_dir(base_run_dir, runs_base, earlier, stem):
    """The run directory of a view's next run: `base_run_dir`, then base-2, base-3, ...;
    else a new one under `runs_base`; else None (the launcher's default)."""
    if base_run_dir:
        base = Path(base_run_dir)
        return base if not earlier else base.with_name(f"{base.name}-{len(earlier) + 1}")
    if runs_base:
        return rundir.new_path(base=runs_base, name=stem)
    return None


class PanelState:
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
        self.error, self.last_run, self.monitor = None, run, monitor.Monitor(run)
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
                run.wait_done(monitor.POLL_S)
        except KeyboardInterrupt:
            stop()
            raise
        if self._click is not None and self._click[0] is run:
            self._click = None   # a later run() starts afresh
        return run.result

    @staticmethod
    def watch(run, draw, standing_aside, failed):
        """The loop of a thread that keeps a view up to date while nobody waits: draw() every
        monitor.POLL_S until the run ends, except while standing_aside() (wait() draws then);
        failed(error) for an exception in draw (the loop goes on)."""
        ended = False
        while not ended:
            ended = run.wait_done(monitor.POLL_S)
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
