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

What a panel holds beyond its drawing (its runs, a click no cell has checked yet, when to
draw) is the notebook side's: notebook/panel_state.py.
"""
import math
import time
from dataclasses import dataclass, field

from . import devices, failures, runs, spec
from ..rank import rundir

POLL_S = 0.25          # how often a view reads new rows and logs
LOG_LINES = 15
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
