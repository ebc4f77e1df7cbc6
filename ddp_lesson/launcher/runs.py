"""Run directories: read one back (also while it runs), compare several.

    runs.MetricsTail(run.run_dir).read()   # metric rows new since the last read (a live view)
    runs.log_tail(run.run_dir, rank=1)     # the last lines rank 1 printed
    runs.load(run.run_dir).rows            # every row so far, as a RunRecord

Layout (the contract): see rundir.py, which owns its names.
"""
import codecs
import json
import os
import statistics
from collections import deque
from pathlib import Path

from . import spec
from ..rank import rundir
from ..rank.metrics import TIME_KEYS   # a step's parts: one list, kept by metrics
from ..rank.rundir import read_json

STRAGGLER_FACTOR = 1.3


class _Tail:
    """Remembers how far each file of a folder was read; `_new(name)` returns what was
    appended since (up to the last newline if whole_lines, so a line being written waits)."""

    MAX_READ = 1 << 20  # per file and call: a rank printing in a loop cannot fill our memory

    def __init__(self, folder):
        self.folder = Path(folder)
        self.offsets = {}
        self.decoders = {}

    def _names(self):
        try:
            return sorted(os.listdir(self.folder))
        except OSError:
            return []

    def _new(self, name, whole_lines=False):
        offset = self.offsets.get(name, 0)
        try:
            with open(self.folder / name, "rb") as f:
                f.seek(offset)
                chunk = f.read(self.MAX_READ)
        except OSError:
            return b""
        end = chunk.rfind(b"\n") + 1
        if whole_lines and (end or len(chunk) < self.MAX_READ):  # (a longer "line" is taken as it is)
            chunk = chunk[:end]
        self.offsets[name] = offset + len(chunk)
        return chunk

    def _text(self, name):
        """New text of `name`; a UTF-8 character split across two reads waits for its end."""
        if name not in self.decoders:
            self.decoders[name] = codecs.getincrementaldecoder("utf-8")("replace")
        return self.decoders[name].decode(self._new(name))


class MetricsTail(_Tail):
    """Reads metrics/rank*.jsonl incrementally: each call returns all rows not seen yet
    (complete lines only, so a row being written is picked up next time)."""

    def __init__(self, run_dir):
        super().__init__(rundir.metrics(run_dir))

    def read(self):
        rows = []
        for name in self._names():
            if not rundir.is_metrics_file(name):
                continue
            # rows are what the caller keeps anyway: read on past MAX_READ until caught up
            while chunk := self._new(name, whole_lines=True):
                for line in chunk.splitlines():
                    try:
                        rows.append(json.loads(line))
                    except ValueError:
                        pass
        rows.sort(key=lambda r: r.get("time", 0))
        return rows


def load_metrics(run_dir):
    return MetricsTail(run_dir).read()


class RunRecord:
    """A finished (or running) run read back from its directory."""

    def __init__(self, run_dir):
        self.path = Path(run_dir)
        if not rundir.config(self.path).exists():
            raise FileNotFoundError(f"{self.path} is not a run directory (no {rundir.CONFIG})")
        self.config = read_json(rundir.config(self.path), {})
        self.result = read_json(rundir.result(self.path))
        self.rows = load_metrics(self.path)

    @property
    def name(self):
        return self.config.get("label") or self.path.name

    @property
    def status(self):
        return (self.result or {}).get("status", "running")

    @property
    def gpus(self):
        """The physical GPU ids the ranks had, [] for CPU ranks (spec.gpus reads config.json)."""
        return spec.gpus(self.config)

    @property
    def device_env(self):
        """What the devices gave every rank's environment, from config.json: CUDA_VISIBLE_DEVICES,
        OMP_NUM_THREADS (a CPU rank's threads), ... (the launch's own env is config["env"])."""
        return spec.device_env(self.config)

    def series(self, key, rank=None, reduce=None):
        """[(step, value)] for one rank, or for all ranks reduced per step with `reduce`
        ("mean" or "sum"), or the rows logged with rank None by a reduced logger."""
        rows = [r for r in self.rows if key in r]
        if rank is not None:
            return [(r["step"], r[key]) for r in rows if r.get("rank") == rank]
        per_step = PerStep()
        for r in rows:
            per_step.add(r["step"], r[key])
        return list(zip(*per_step.reduce(reduce or "mean")[::2]))

    def ranks(self):
        return sorted({r["rank"] for r in self.rows if "rank" in r})

    def last(self, key, rank=None):
        s = self.series(key, rank=rank)
        return s[-1][1] if s else None

    def summary(self):
        res = self.result or {}
        return {"run": self.name, "status": self.status, "nproc": self.config.get("nproc"),
                "backend": self.config.get("backend"), "duration_s": res.get("duration_s"),
                "final_loss": self.last("loss"), "final_accuracy": self.last("test_accuracy"),
                "samples_per_s": self.last("samples_per_s")}

    def stragglers(self, factor=STRAGGLER_FACTOR):
        """Ranks whose median data_s + compute_s per step is above `factor` (1.3) times the median of
        the other ranks' medians; [] for an even run (or one without compute_s rows)."""
        return StepTimes().add(self.rows).stragglers(factor)

    def state_dict(self, name=rundir.MODEL):
        """The weights a lesson script saved at the end of the run (rank 0 writes
        `model.state_dict()` of the inner model to <run dir>/model.pt), loaded onto the CPU
        with weights_only=True: `models.SmallCNN().load_state_dict(rec.state_dict())`."""
        import torch  # here, not at the top: reading metrics must not need torch
        path = self.path / name
        if not path.exists():
            raise FileNotFoundError(f"{self.path} has no {name}: the script saved no model "
                                    f"(or the run ended before it did).")
        return torch.load(path, map_location="cpu", weights_only=True)

    def __repr__(self):
        return f"RunRecord({str(self.path)!r}, status={self.status!r}, rows={len(self.rows)})"


class PerStep:
    """One metric reduced over ranks per step, built as rows arrive (live plots add rows
    each frame). Each step also carries an x (a time, say), averaged over the ranks."""

    def __init__(self):
        self._sums = {}      # step -> [sum x, sum y, count]

    def add(self, step, y, x=None):
        acc = self._sums.setdefault(step, [0.0, 0.0, 0])
        acc[0] += step if x is None else x
        acc[1] += y
        acc[2] += 1

    def reduce(self, how="mean"):
        """([step], [mean x], [mean y or sum y]) in step order."""
        items = sorted(self._sums.items())
        steps = [s for s, _ in items]
        xs = [sx / n for _, (sx, _, n) in items]
        ys = [sy if how == "sum" else sy / n for _, (_, sy, n) in items]
        return steps, xs, ys


def load(run_dir):
    return RunRecord(run_dir)


class StepTimes:
    """Per rank, the time split of the last `window` steps (all steps when None), from
    rows that carry compute_s; rows can be added as they arrive (a live panel)."""

    def __init__(self, window=None):
        self.window = window
        self.per_rank = {}   # rank -> {key: deque of values}
        self.mem_mb = {}     # rank -> the last mem_mb

    def add(self, rows):
        for r in rows:
            if r.get("compute_s") is None or r.get("rank") is None:
                continue
            keys = self.per_rank.setdefault(r["rank"], {k: deque(maxlen=self.window) for k in TIME_KEYS})
            for k in TIME_KEYS:
                keys[k].append(r.get(k) or 0.0)
            if r.get("mem_mb") is not None:
                self.mem_mb[r["rank"]] = r["mem_mb"]
        return self

    def medians(self):
        """{rank: {"data_s", "compute_s", "wait_s": median seconds per step}}, by rank."""
        return {rank: {k: statistics.median(v) for k, v in keys.items()}
                for rank, keys in sorted(self.per_rank.items())}

    def stragglers(self, factor=STRAGGLER_FACTOR):
        """The rule: a rank is a straggler when its median busy time per step (data_s +
        compute_s: all but waiting for the others) exceeds `factor` x the median of the other
        ranks' medians. Needs two ranks or more. A slow loader makes a straggler too."""
        med = {rank: m["data_s"] + m["compute_s"] for rank, m in self.medians().items()}
        out = []
        for rank, m in med.items():
            others = [v for q, v in med.items() if q != rank]
            if others and m > factor * statistics.median(others):
                out.append(rank)
        return out


def compare(run_dirs):
    """One summary dict per run, in the given order."""
    return [load(d).summary() for d in run_dirs]


class LogTail(_Tail):
    """New text of the ranks' log files since the last call: [(rank, stream, text)]."""

    def __init__(self, run_dir, ranks=None, streams=("stdout", "stderr")):
        super().__init__(rundir.logs(run_dir))
        self.ranks, self.streams = ranks, streams

    def read(self):
        out = []
        for name in self._names():
            which = rundir.rank_log_of(name)
            if not which or which[1] not in self.streams:
                continue
            rank, stream = which
            if self.ranks is not None and rank not in self.ranks:
                continue
            data = self._text(name)
            if data:
                out.append((rank, stream, data))
        return out


def log_tail(run_dir, rank=0, lines=20, stream="stdout"):
    """The last `lines` lines a rank wrote to its stdout (or stderr) so far: also while it runs."""
    return tail_text(rundir.rank_log(run_dir, rank, stream), lines)


def tail_text(path, lines=20):
    """The last `lines` lines of a text file ('' when missing); progress bars drawn with
    carriage returns keep only their last state."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            start = f.tell()
            data = f.read()
            if start:  # we may have landed inside a character: skip its continuation bytes
                data = data.lstrip(bytes(range(0x80, 0xC0)))
            text = data.decode("utf-8", "replace")
    except OSError:
        return ""
    # split on "\n" only: str.splitlines() also splits on "\r" and would keep every frame
    parts = text.split("\n")
    if parts and parts[-1] == "":
        parts.pop()
    kept = [line.rstrip("\r").rsplit("\r", 1)[-1] for line in parts]
    return "\n".join(kept[-lines:])
