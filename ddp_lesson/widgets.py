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
- Frames are throttled to 4 per second at most, and to fewer when a frame is slow to draw
  (a frame may use ~5% of one core), because on a small machine the kernel shares cores
  with the ranks it watches.
"""
import html
import threading
import time
from pathlib import Path

import ipywidgets as W
from IPython.display import Image, display, update_display

from . import BadInput, devices, failures, launch, plots, runs

POLL_S = 0.25          # how often the panel reads new metric rows
MIN_FRAME_S = 0.25     # at most 4 frames per second
FRAME_BUDGET = 0.05    # a frame may cost this share of the time between frames
MAX_FRAME_S = 2.0      # ... but a live plot never waits longer than this
LOG_LINES = 15

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
        nproc = nproc or devices.default_cpu_nproc()  # DDP_LESSON_NPROC, else 2
        max_nproc = max_nproc or max(4, devices.cpu_count() * 2)
        self.nproc = W.BoundedIntText(value=min(nproc, max_nproc), min=1, max=max_nproc,
                                      description="processes", layout=W.Layout(width="170px"))
        cpu_note = W.HTML("Ranks are CPU processes on the <b>gloo</b> backend.")
        if self.gpus:
            # A GPU another process uses starts unticked; if all are busy, tick them all.
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


class RunPanel:
    """Run / Stop buttons, options, device picker, status line, log tail and a live plot
    for one training script. See the module docstring for how it updates itself."""

    def __init__(self, script, options=None, picker=None, metrics=("loss", "accuracy"),
                 x="step", label=None, run_dir=None, runs_base=None, timeout=None,
                 extra_args=()):
        self.script = Path(script)
        self.options = dict(options or {})
        self.picker = picker if picker is not None else DevicePicker()
        self.metrics, self.x, self.label = tuple(metrics), x, label
        self.base_run_dir, self.runs_base = run_dir, runs_base
        self.timeout, self.extra_args = timeout, [str(a) for a in extra_args]
        self.last_run = None
        self.runs = []          # run directories launched from this panel, oldest first
        self.error = None       # the sentence of the last bad input, until a run starts
        self.frames = 0         # plot frames rendered (tests and the benchmark read it)
        self.png = None         # the last frame
        self.frame_s = 0.0      # how long the last frame took to draw
        self._live = plots.LivePlot(self.metrics, x=x)
        self._lock = threading.RLock()
        self._waiting = False
        self._monitor = None
        self._display_id = None
        self._last_frame = 0.0
        self._drawn_points = -1
        self._log_text = None
        self._status = ("idle", "")

        self.inputs = {name: _option_widget(name, value) for name, value in self.options.items()}
        self.run_button = W.Button(description="Run", button_style="success", icon="play")
        self.stop_button = W.Button(description="Stop", button_style="danger", icon="stop",
                                    disabled=True)
        self.run_button.on_click(lambda _: self.run())
        self.stop_button.on_click(lambda _: self._stop_in_background())
        self.status_html = W.HTML()
        self.log_html = W.HTML()
        title = W.HTML(f"<b>{html.escape(self.script.name)}</b>")
        self.widget = W.VBox([
            title,
            W.HBox(list(self.inputs.values()), layout=W.Layout(flex_flow="row wrap")),
            self.picker.widget,
            W.HBox([self.run_button, self.stop_button]),
            self.status_html,
            self.log_html,
        ])
        self._set_status("idle", "Press Run to start.")

    # -- what the notebook sees -------------------------------------------------------
    @property
    def status(self):
        """"idle", "running", "stopping", "ok", "failed", "interrupted", "timeout" or
        "bad input"."""
        return self._status[0]

    @property
    def status_text(self):
        return self._status[1]

    @property
    def log_text(self):
        return self._log_text or ""

    @property
    def result(self):
        return self.last_run.result if self.last_run else None

    @property
    def run_dir(self):
        return self.last_run.run_dir if self.last_run else None

    def values(self):
        """The options as the widgets hold them now."""
        return {name: w.value for name, w in self.inputs.items()}

    def _ipython_display_(self):
        if self._display_id is None:
            self._display_id = f"ddp-lesson-plot-{id(self):x}-{time.time_ns():x}"
        display(self.widget)
        if self.png is None:
            display({"text/plain": "(the live plot appears here once a run logs metrics)"},
                    raw=True, display_id=self._display_id)
        else:
            display(Image(data=self.png, format="png"), display_id=self._display_id)

    # -- actions ----------------------------------------------------------------------
    def run(self, **overrides):
        """Start a run with the options in the widgets, changed by `overrides`
        (batch_size=... also sets "batch-size"). Returns the launch.Run at once, or None
        when the input was bad: then the status line says why and nothing started."""
        with self._lock:
            if self.last_run is not None and not self.last_run.done():
                self._set_status("running", "A run is already going; press Stop first. "
                                 + self._running_text())
                return None
            try:
                self._apply(overrides)
                run = launch.start(self.script, args=option_args(self.values()) + self.extra_args,
                                   run_dir=self._next_run_dir(), timeout=self.timeout,
                                   label=self.label, **self.picker.selection())
            except BadInput as e:
                self.error = str(e)
                self._set_status("bad input", f"Not started: {e}")
                return None
            self.error = None
            self.last_run = run
            self.runs.append(run.run_dir)
            self._live.reset(t0=run.config.get("start_unix"))
            self._drawn_points, self._last_frame, self._log_text = -1, 0.0, None
            self._set_busy(True)
            self._set_status("running", self._running_text())
            self._set_log("")
            self._monitor = threading.Thread(target=self._watch, args=(run,), daemon=True,
                                             name="ddp-lesson-panel")
            self._monitor.start()
            return run

    def wait(self, timeout=None):
        """Block until the run ends, keeping plot, status and log up to date from this
        thread; returns the result dict (None if still running after `timeout` s). An
        interrupt stops the run, shows it as interrupted, then propagates."""
        run = self.last_run
        if run is None:
            raise BadInput(self.error or "Nothing to wait for: press Run or call panel.run() first.")
        if self._display_id is None and _in_kernel():
            display(self)  # headless `panel.run(); panel.wait()`: show it where it runs
        end = None if timeout is None else time.monotonic() + timeout
        self._waiting = True
        try:
            while not run.done():
                self._tick(run)
                if end is not None and time.monotonic() >= end:
                    return None
                run._done.wait(POLL_S)
        except KeyboardInterrupt:
            self.stop()
            raise
        finally:
            self._waiting = False
        self._finish(run)
        return run.result

    def stop(self):
        """End every process of the run (what Stop does); returns the result."""
        run = self.last_run
        if run is None or run.done():
            return self.result
        self._set_status("stopping", "Stopping: ending every process of the run ...")
        self.stop_button.disabled = True
        run.stop()
        self._finish(run)
        return run.result

    def _stop_in_background(self):
        # A click must not hold up the kernel for the seconds a clean stop can take.
        threading.Thread(target=self.stop, daemon=True, name="ddp-lesson-stop").start()

    # -- inside -----------------------------------------------------------------------
    def _apply(self, overrides):
        for key, value in overrides.items():
            name = key if key in self.inputs else key.replace("_", "-")
            if name not in self.inputs:
                known = ", ".join(self.inputs) or "none"
                raise BadInput(f"This panel has no option {key!r}; its options are: {known}.")
            w = self.inputs[name]
            try:
                w.value = value
            except Exception:
                raise BadInput(f"Option {name} cannot be {value!r}.") from None
            if w.value != value:  # e.g. 0.5 into a whole-number box
                raise BadInput(f"Option {name} takes a value like {self.options[name]!r}, got {value!r}.")

    def _next_run_dir(self):
        stem = self.label or self.script.stem
        if self.base_run_dir:
            base = Path(self.base_run_dir)
            return base if not self.runs else base.with_name(f"{base.name}-{len(self.runs) + 1}")
        if self.runs_base:
            return runs.new_run_dir(base=self.runs_base, name=stem)
        return None

    def _watch(self, run):
        """The click path: poll until the run ends unless wait() is doing it."""
        while not run.done():
            if not self._waiting:
                try:
                    self._tick(run)
                except Exception as e:  # keep watching; say what went wrong
                    self._set_log(f"(panel could not update: {e!r})")
            run._done.wait(POLL_S)
        if not self._waiting:
            self._finish(run)

    def _tick(self, run, final=False):
        with self._lock:
            if run is not self.last_run:
                return
            self._live.add(run.metrics())
            if not final and not run.done():
                self._set_status("running", self._running_text())
            self._set_log(run.log_tail(lines=LOG_LINES))
            self._maybe_draw(run, final)

    def _finish(self, run):
        with self._lock:
            if run is not self.last_run or run.result is None:
                return
            try:
                self._tick(run, final=True)
            finally:  # whatever the plot did, the buttons and status must be right
                self._show_result(run)

    def _show_result(self, run):
        res = run.result
        self._set_status(res["status"], self._result_text(res))
        log = run.log_tail(lines=LOG_LINES)
        if res["status"] == "failed":
            log = (log + "\n\n" if log else "") + res.get("message", "")
        self._set_log(log)
        self._set_busy(False)

    def _maybe_draw(self, run, final):
        points = self._live.points()
        now = time.monotonic()
        interval = min(MAX_FRAME_S, max(MIN_FRAME_S, self.frame_s / FRAME_BUDGET))
        if not final and (points == self._drawn_points or now - self._last_frame < interval):
            return
        if final and points == self._drawn_points and self.png is not None and \
                self._title(run) == self._live._title:
            return
        t = time.perf_counter()
        self.png = self._live.render(self._title(run))
        self.frame_s = time.perf_counter() - t
        self.frames += 1
        self._last_frame, self._drawn_points = now, points
        if self._display_id is not None:
            update_display(Image(data=self.png, format="png"), display_id=self._display_id)

    def _title(self, run):
        res = run.result
        state = res["status"] if res else "running"
        extra = f", {res['duration_s']:.1f} s" if res and res.get("duration_s") is not None else ""
        return f"{run.config.get('label', run.run_dir.name)}: {state}{extra}  ({self._where(run)})"

    def _where(self, run):
        n = run.config.get("nproc")
        devs = run.config.get("devices")
        return f"{n} CPU process(es), gloo" if devs == "cpu" else f"GPU {','.join(map(str, devs))}, {run.config.get('backend')}"

    def _running_text(self):
        run = self.last_run
        if run is None:
            return ""
        rows = run.rows
        step = max((r.get("step", 0) for r in rows[-50:]), default=None)
        at = f", step {step}" if step is not None else ", starting"
        return f"Running: {self._where(run)}{at}, {time.monotonic() - run._t0:.0f} s. Run dir: {run.run_dir}"

    def _result_text(self, res):
        status = res["status"]
        if status == "ok":
            rec_bits = []
            for key, fmt in (("loss", "{:.3f}"), ("accuracy", "{:.1%}")):
                vals = [r[key] for r in self.last_run.rows if key in r]
                if vals:
                    rec_bits.append(f"{key} {fmt.format(vals[-1])}")
            tail = (", " + ", ".join(rec_bits)) if rec_bits else ""
            return f"Finished ok in {res['duration_s']:.1f} s{tail}. Run dir: {self.run_dir}"
        if status == "failed":
            f = res.get("failure")
            if f:
                return "Failed: " + failures.headline(f)
            return "Failed: " + res.get("message", "see logs/agent.log in the run directory.").splitlines()[0]
        if status == "interrupted":
            return "Interrupted: " + res.get("message", "the run was stopped.")
        if status == "timeout":
            return "Timed out: " + res.get("message", "")
        return status

    def _set_status(self, state, text):
        if (state, text) == self._status:
            return
        self._status = (state, text)
        color = STATUS_COLORS.get(state, "black")
        self.status_html.value = (f"<span style='color:{color}'><b>{html.escape(state)}</b></span> "
                                  f"{html.escape(text)}")

    def _set_log(self, text):
        if text == self._log_text:
            return  # sending the same widget value again costs a message for nothing
        self._log_text = text
        self.log_html.value = (f"<pre style='max-height:16em;overflow:auto;font-size:85%;"
                               f"margin:0'>{html.escape(text)}</pre>" if text else "")

    def _set_busy(self, busy):
        self.run_button.disabled = busy
        self.stop_button.disabled = not busy
        self.picker.disabled = busy
        for w in self.inputs.values():
            w.disabled = busy

    def __repr__(self):
        return f"<RunPanel {self.script} {self.status}>"

