"""Notebook widgets: pick devices, run a training script under torchrun, watch it.

    picker = DevicePicker()                         # a checkbox per GPU, or a CPU count
    panel = RunPanel("work/train.py", options={"epochs": 2, "sync-bn": False})
    panel                                           # Run / Stop, status, log tail, live plot
    panel.run(epochs=1); result = panel.wait()      # the same from code (headless runs)

How the panel keeps itself up to date:
- panel.wait() polls from the kernel's main thread, so Interrupt (KeyboardInterrupt)
  reaches it and stops the run; this is the path of headless runs (nbval, nbclient).
- After a click on Run nobody waits, so a daemon thread polls instead. It only reads
  files, renders PNGs (Agg, on a figure of its own) and sends widget values and display
  updates, which ipykernel sends from any thread. A thread rather than an asyncio task on
  the kernel's loop: a task would freeze while any other cell runs, a thread does not.
  While wait() runs, the thread stands aside so only one of them draws.
- The plot is a display handle (display(..., display_id=...) then update_display), not a
  widget: updated in place, it stays ONE output under nbval/nbclient, and the last frame
  stays in the saved notebook as a plain PNG. No clear_output, no ipympl.
- A learner may press Run and then also run the cell that calls run() and wait(): that
  cell checks the clicked run when it has the cell's settings, else waits for it to end and
  starts its own (RunPanel.run), so it never checks a run with other settings.
- What to show comes from a monitor.Monitor (the command line's follow loop uses the same);
  when to draw from a panel_state.FrameClock: 4 frames per second at most, fewer when a frame
  is slow to draw, because on a small machine the kernel shares cores with the ranks.
"""
import html
import threading
import time

import ipywidgets as W
from IPython.display import Image, display, update_display

from .. import BadInput
from ..launcher import devices, launch, monitor, validate
from . import panel_state, plots

STATUS_COLORS = {"running": "#1f6feb", "ok": "#1a7f37", "failed": "#cf222e",
                 "interrupted": "#9a6700", "timeout": "#cf222e", "bad input": "#cf222e",
                 "idle": "#57606a", "stopping": "#9a6700"}


def _in_kernel():
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


class DevicePicker:
    """Which devices a run gets, as keyword arguments for launch.start (see selection()).

    gpus: a list of devices.GPU, or None to detect them with nvidia-smi."""

    def __init__(self, gpus=None, nproc=None, max_nproc=None):
        self.gpus = devices.list_gpus() if gpus is None else list(gpus)
        nproc = nproc or devices.default_cpu_nproc()  # DDP_LESSON_NPROC, else 2 (1 with one usable core)
        # the cap plan() and %ranks start allow without asking on purpose (validate.max_cpu_ranks),
        # never below the default, so the picker starts where plan() does
        max_nproc = max_nproc or max(nproc, validate.max_cpu_ranks(devices.cpu_count()))
        self.nproc = W.BoundedIntText(value=min(nproc, max_nproc), min=1, max=max_nproc,
                                      description="processes", layout=W.Layout(width="170px"))
        cpu_note = W.HTML("Ranks are CPU processes on the <b>gloo</b> backend.")
        if self.gpus:
            # The default is devices.default_gpus, the one policy of plan() and %ranks start:
            # every free GPU when there are two or more, else CPU processes. The boxes of the
            # free GPUs start ticked (all of them when every GPU is busy), for unticking CPU.
            default = devices.default_gpus(self.gpus)
            free = [g for g in self.gpus if not g.busy] or self.gpus
            self.boxes = [W.Checkbox(value=g in free, description=g.label(), indent=False,
                                     layout=W.Layout(width="auto")) for g in self.gpus]
            self.use_cpu = W.Checkbox(value=False, description="use CPU processes instead",
                                      indent=False, layout=W.Layout(width="auto"))
            self.cpu_row = W.HBox([self.nproc, cpu_note])
            self.cpu_row.layout.display = "none"
            self.use_cpu.observe(self._toggle_cpu, "value")
            children = [W.HTML("<b>GPUs</b> (one process each, <b>nccl</b>)"), *self.boxes,
                        self.use_cpu, self.cpu_row]
            if not default:
                # Fewer than two free GPUs: start on CPU processes, so that a learner sees
                # several ranks, as every run that names no device does.
                self.use_cpu.value = True
                why = "One GPU" if len(self.gpus) == 1 else "Fewer than two free GPUs"
                children.append(W.HTML(
                    f"{why}: {self.nproc.value} CPU processes by default, so you see "
                    f"{self.nproc.value} ranks; untick to train on the GPUs ticked above."))
        else:
            self.boxes, self.use_cpu = [], None
            children = [W.HBox([self.nproc, cpu_note])]
        self.widget = W.VBox(children)

    def _toggle_cpu(self, change):
        on = change["new"]
        self.cpu_row.layout.display = "" if on else "none"
        for box in self.boxes:
            box.disabled = on

    def selection(self):
        """{"gpus": [0, 1]}, {"cpu": True, "nproc": 2}, or {"nproc": 2} with no GPU."""
        if not self.gpus:
            return {"nproc": int(self.nproc.value)}
        if self.use_cpu.value:
            return {"cpu": True, "nproc": int(self.nproc.value)}
        return {"gpus": [g.index for g, box in zip(self.gpus, self.boxes) if box.value]}

    def describe(self):
        sel = self.selection()
        if "gpus" in sel:
            return f"{len(sel['gpus'])} GPU process(es) on GPU {','.join(map(str, sel['gpus']))}"
        return f"{sel['nproc']} CPU process(es) on gloo"

    @property
    def disabled(self):
        return self.nproc.disabled

    @disabled.setter
    def disabled(self, value):
        for w in [self.nproc, *self.boxes] + ([self.use_cpu] if self.use_cpu else []):
            w.disabled = value
        if not value and self.use_cpu is not None and self.use_cpu.value:
            for box in self.boxes:
                box.disabled = True

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


def _option_widget(name, value):
    """A widget that fits the option's type (bool before int: True is an int too)."""
    layout = W.Layout(width="210px")
    style = {"description_width": "initial"}
    if isinstance(value, bool):
        return W.Checkbox(value=value, description=name, indent=False, layout=W.Layout(width="auto"))
    if isinstance(value, int):
        return W.IntText(value=value, description=name, layout=layout, style=style)
    if isinstance(value, float):
        return W.FloatText(value=value, description=name, layout=layout, style=style)
    return W.Text(value="" if value is None else str(value), description=name, layout=layout,
                  style=style)


def option_args(options):
    """Script arguments: {"epochs": 2} -> --epochs 2; True -> --flag; False/None -> nothing."""
    args = []
    for name, value in options.items():
        if value is False or value is None:
            continue
        args.append(f"--{name}")
        if value is not True:
            args.append(str(value))
    return args


def apply_overrides(inputs, defaults, overrides):
    """Put `overrides` into the option widgets (batch_size=... also sets "batch-size");
    BadInput, one sentence, for an unknown option or a value its widget cannot hold."""
    for key, value in overrides.items():
        name = key if key in inputs else key.replace("_", "-")
        if name not in inputs:
            known = ", ".join(inputs) or "none"
            raise BadInput(f"This panel has no option {key!r}; its options are: {known}.")
        w = inputs[name]
        try:
            w.value = value
        except Exception:
            raise BadInput(f"Option {name} cannot be {value!r}.") from None
        if w.value != value:  # e.g. 0.5 into a whole-number box
            raise BadInput(f"Option {name} takes a value like {defaults[name]!r}, got {value!r}.")


def status_markup(state, text):
    return (f"<span style='color:{STATUS_COLORS.get(state, 'black')}'><b>{html.escape(state)}</b></span> "
            f"{html.escape(text)}")


def log_markup(text):
    return f"<pre style='max-height:16em;overflow:auto;font-size:85%;margin:0'>{html.escape(text)}</pre>" if text else ""


class LiveFrame:
    """The live plot as one display handle (display, then update_display): updated in
    place, drawn only when its FrameClock says a frame is due."""

    def __init__(self, metrics=("loss", "test_accuracy"), x="step"):
        self.live = plots.LivePlot(metrics, x=x)
        self.clock = panel_state.FrameClock()
        self.png = None          # the last frame
        self.display_id = None   # set once shown

    def reset(self, t0=None):
        self.live.reset(t0=t0)
        self.clock = panel_state.FrameClock()

    def show(self):
        if self.display_id is None:
            self.display_id = f"ddp-lesson-plot-{id(self):x}-{time.time_ns():x}"
        if self.png is None:
            display({"text/plain": "(the live plot appears here once a run logs metrics)"},
                    raw=True, display_id=self.display_id)
        else:
            display(Image(data=self.png, format="png"), display_id=self.display_id)

    def update(self, rows, title, final=False, times=None, stragglers=()):
        """times, stragglers: the monitor's runs.StepTimes and its verdict on them, drawn as
        bars beside the curves."""
        self.live.add(rows)
        points = self.live.points()
        if not self.clock.due(points, title, final):
            return
        t = time.perf_counter()
        self.live.title = title
        self.png = self.live.render(times=times, stragglers=stragglers)
        self.clock.drawn(points, title, time.perf_counter() - t)
        if self.display_id is not None:
            update_display(Image(data=self.png, format="png"), display_id=self.display_id)


class RunPanel:
    """Run / Stop, options, device picker, status, log tail, live plot and step-time bars for
    one training script: a view of a panel_state.PanelState (its runs) and of the Monitor of the
    latest one. What to show comes from there; the panel draws it."""

    def __init__(self, script, options=None, picker=None, metrics=("loss", "test_accuracy"),
                 x="step", label=None, run_dir=None, runs_base=None, timeout=None,
                 extra_args=()):
        self.session = panel_state.PanelState(script, label=label, run_dir=run_dir, runs_base=runs_base,
                                       timeout=timeout, extra_args=extra_args)
        self.script, self.options = self.session.script, dict(options or {})
        self.picker = picker if picker is not None else DevicePicker()
        self.plot = LiveFrame(metrics, x=x)
        self.last_update = None   # the monitor.Update shown last: what the views drew
        self.status, self.status_text, self.log_text, self._waiting = "idle", "", "", False
        self._lock = threading.RLock()   # one poll (and draw) at a time: thread or wait()
        self.inputs = {name: _option_widget(name, value) for name, value in self.options.items()}
        self.run_button = W.Button(description="Run", button_style="success", icon="play")
        self.stop_button = W.Button(description="Stop", button_style="danger", icon="stop", disabled=True)
        self.run_button.on_click(lambda _: self._click())
        self.stop_button.on_click(lambda _: threading.Thread(target=self.stop, daemon=True).start())
        self.status_html, self.log_html, self.resources_html = W.HTML(), W.HTML(), W.HTML()
        self.widget = W.VBox([
            W.HTML(f"<b>{html.escape(self.script.name)}</b>"),
            W.HBox(list(self.inputs.values()), layout=W.Layout(flex_flow="row wrap")),
            self.picker.widget, W.HBox([self.run_button, self.stop_button]),
            self.status_html, self.resources_html, self.log_html])
        self._set_status("idle", "Press Run to start.")

    frames = property(lambda self: self.plot.clock.frames, doc="plot frames drawn so far")
    frame_s = property(lambda self: self.plot.clock.frame_s, doc="seconds the last frame took")
    png = property(lambda self: self.plot.png, doc="the last frame")
    last_run = property(lambda self: self.session.last_run)
    rows = property(lambda self: self.session.monitor.rows if self.session.monitor else [],
                    doc="the last run's metric rows, as its monitor read them so far")
    runs = property(lambda self: self.session.runs, doc="run directories launched here, oldest first")
    error = property(lambda self: self.session.error, doc="the last bad input's sentence")
    result = property(lambda self: self.last_run.result if self.last_run else None)
    run_dir = property(lambda self: self.last_run.run_dir if self.last_run else None)

    def values(self):  # the options as the widgets hold them now
        return {name: w.value for name, w in self.inputs.items()}

    def _ipython_display_(self):
        launch.warm_up()   # torch imported before Run is pressed (returns at once)
        display(self.widget)
        self.plot.show()

    def run(self, **overrides):
        """Start a run with the options in the widgets, changed by `overrides` (batch_size=...
        also sets "batch-size"). Returns the launch.Run at once, or None when the input was
        bad: the status line says why, nothing started, and wait() raises. After a click on
        Run, PanelState.for_cell says whether this cell checks that run."""
        def apply():   # the overrides into the widgets; False (the status says why) if bad
            try:
                return apply_overrides(self.inputs, self.options, overrides) or True
            except BadInput as e:
                return self._bad_input(e)
        clicked = self.session.for_cell(apply, self._settings, self.wait)
        return self._start(**overrides) if clicked is None else clicked or None

    def _click(self):
        settings, run = self._settings(), self._start()   # the settings as clicked, then the run
        if run is not None:   # a click refused while a run is going keeps the earlier record
            self.session.clicked(run, settings)

    def _settings(self):
        return self.session.settings(option_args(self.values()), self.picker.selection())

    def _bad_input(self, e):
        self.session.error = str(e)
        self._set_status("bad input", f"Not started: {e}")

    def _start(self, **overrides):
        with self._lock:
            if self.session.going():
                self._set_status("running", "A run is already going; press Stop first. "
                                 + monitor.running_text(self.last_run, self.rows))
                return None
            try:
                apply_overrides(self.inputs, self.options, overrides)
                run = self.session.start(option_args(self.values()), self.picker.selection())
            except BadInput as e:
                return self._bad_input(e)
            self.last_update = None
            self.plot.reset(t0=run.config.get("start_unix"))
            self._set_busy(True)
            self._set_status("running", monitor.running_text(run, self.rows))
            self._set_log("")
            threading.Thread(target=self.session.watch, daemon=True, name="ddp-lesson-panel",  # after a click
                             args=(run, lambda: self._update(run), lambda: self._waiting,      # nobody waits
                                   lambda e: self._set_log(f"(panel could not update: {e!r})"))).start()
            return run

    def wait(self, timeout=None):
        """Block until the run ends, updating the panel from this thread; the result (None
        if still running after `timeout` s). An interrupt stops the run, then propagates."""
        run = self.session.to_wait()   # BadInput after bad input: not the earlier run's result
        if self.plot.display_id is None and _in_kernel():
            display(self)  # headless `panel.run(); panel.wait()`: show it where it runs
        self._waiting = True
        try:
            return self.session.follow(run, lambda: self._update(run), self.stop, timeout)
        finally:
            self._waiting = False

    def stop(self):
        """End every process of the run (what Stop does); returns the result."""
        run = self.last_run
        if run is None or run.done():
            return self.result
        self._set_status("stopping", "Stopping: ending every process of the run ...")
        self.stop_button.disabled = True
        run.stop()
        self._update(run)
        return run.result

    def _update(self, run):
        """Draw one poll of the session's monitor; True once the run ended."""
        with self._lock:
            if run is not self.last_run:
                return True
            u = self.session.monitor.poll()
            try:
                self._set_log(u.log)
                self.resources_html.value = html.escape(u.resources)  # who is slow, memory, GPU use
                self.plot.update(u.rows, u.title, final=u.ended, times=u.times, stragglers=u.stragglers)
                self.last_update = u
            finally:  # whatever the plot did, the buttons and status must be right
                self._set_status(u.state, u.text)
                if u.ended:
                    self._set_busy(False)
            return u.ended

    def _set_status(self, state, text):
        if (state, text) != (self.status, self.status_text):  # an unchanged value costs a message
            self.status, self.status_text = state, text
            self.status_html.value = status_markup(state, text)

    def _set_log(self, text):
        if text != self.log_text:
            self.log_text = text
            self.log_html.value = log_markup(text)

    def _set_busy(self, busy):
        self.stop_button.disabled = not busy
        for w in [self.run_button, self.picker, *self.inputs.values()]:
            w.disabled = busy

    def __repr__(self):
        return f"<RunPanel {self.script} {self.status}>"
