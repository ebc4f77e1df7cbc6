"""Script side: one JSON line per call in metrics/rank<R>.jsonl of the run directory.

    from ddp_lesson.rank import metrics
    metrics.log(step, loss=loss, train_accuracy=acc)

Cheap enough for every step (one small write, flushed). Outside the launcher
(DDP_LESSON_RUN_DIR unset, e.g. plain torchrun) it does nothing.

A script's other files go into the same run directory, named by run_dir(), save_json()
and checkpoint_path(); outside the launcher that is the current directory.

One vocabulary for every script (plots take their axis labels from LABELS):
- `loss`            this rank's training loss on its batch, every step
- `train_accuracy`  this rank's accuracy on its training batch, every step (tiny batches
                    make it jagged; plots smooth per-step curves)
- `test_accuracy`   accuracy over the whole test set, counted over all ranks, with
                    `test_samples` (the samples counted) once per evaluation
- `compute_s`, `wait_s`, `data_s`, `mem_mb`  where a step's time and memory go (StepTimer)
- `samples_per_s`, `epoch_s`, `lr`, `step_ms`  as their names say

StepTimer splits each training step of this rank into
- `data_s`: waiting for the next batch from the loader (timed around its `next()`),
- `wait_s`: the time this rank spends in DDP's two sync points, where it waits for the others:
  1. DDP's forward starts by broadcasting rank 0's buffers (BatchNorm's running statistics) to
     every rank. Timed from the moment DDP's forward is called until the wrapped model's own
     forward begins.
  2. The gradient all-reduce: from the moment backward produced this rank's last gradient until
     backward returned (timer.backward_done(), where a script calls it), else until the
     optimizer step began. DDP makes `loss.backward()` return only once the all-reduce is done.
  A collective cannot finish before every rank has joined it, so a fast rank waits in one of
  these for a slow one. A delay before the forward (a slow loader) is waited out in the first
  where the model has buffers, else in the second; a delay between forward and last gradient
  in the second.
  What a script runs after backward and before the step (clipping, say) counts here, unless
  it calls backward_done() right after backward, as gpt_ddp.py does. On GPUs the moments are CUDA events,
  marks on the GPU's queue of work: the time is the GPU's waiting, not the host's.
- `compute_s`: the rest of the step (forward, backward, optimizer, logging).
- `mem_mb`: peak CUDA memory of the step on a GPU, the process's resident set on a CPU.
The timer only watches: it leaves DDP's averaging as it is (no comm hook). Collectives outside
those two (SyncBatchNorm's, in forward; gpt_ddp.py's all-reduce of the logged loss after the
step) count as compute: a rank waiting there is logged as computing.
DDP_LESSON_STEP_TIMES=0 turns the timer off (lap() returns {}), for benchmarks.
"""
import json
import math
import os
import sys
import time
from pathlib import Path

from . import rundir

LABELS = {"loss": "training loss (per batch)", "train_accuracy": "training batch accuracy",
          "test_accuracy": "test accuracy", "test_samples": "test samples counted",
          "samples_per_s": "samples / s", "compute_s": "compute per step (s)",
          "wait_s": "waiting for the other ranks per step (s)", "data_s": "data loading per step (s)",
          "mem_mb": "memory (MB)", "epoch_s": "seconds per epoch", "lr": "learning rate",
          "step_ms": "ms per step", "step": "step", "time": "seconds since start"}
TIME_KEYS = ("data_s", "compute_s", "wait_s")  # a step's parts, in the order they happen

_file = None


def _open():
    global _file
    run_dir = rundir.from_env()
    if not run_dir:
        return None
    path = rundir.metrics_file(run_dir, os.environ.get("RANK", "0"))
    path.parent.mkdir(parents=True, exist_ok=True)
    _file = open(path, "a", buffering=1)
    return _file


def close():
    """Close this process's metrics file; the next log() opens it again, in the run directory
    the environment names then."""
    global _file
    if _file is not None:
        _file.close()
        _file = None


def log(step, **values):
    """Append {rank, step, time, **values}; tensors and numpy scalars become floats."""
    f = _file or _open()
    if f is None:
        return
    row = {"rank": int(os.environ.get("RANK", "0")), "step": int(step), "time": time.time()}
    for k, v in values.items():
        if hasattr(v, "item"):
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            v = None  # NaN/inf are not JSON: a diverged loss is written as null
        row[k] = v
    f.write(json.dumps(row, allow_nan=False) + "\n")  # line-buffered: the newline flushes it


def run_dir():
    """This run's folder (`.` outside a course launch): a script's files go where the notebook looks."""
    return rundir.from_env(Path("."))


def save_json(name, data):
    """Write a script's result file run_dir()/name atomically: a notebook never reads half of it."""
    path = run_dir() / name
    rundir.write_json(path, data)
    return path


def checkpoint_path():
    """Where rank 0 saves the trained weights: the file runs.load(run_dir).state_dict() loads."""
    return run_dir() / rundir.MODEL


def log_process(step=0, **values):
    """One row about this rank's process, for 00's process-tree picture: its pid, its parent's
    (the torchrun agent) and the agent's parent (the kernel, or the warm process that forked
    the agent for it), its local rank, the world size, the ranks' store, whether torchrun says
    the agent hosts it (TORCHELASTIC_USE_AGENT_STORE; not with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
    and the ports the agent listens on (the rendezvous store and, by default, the ranks' store).
    A warm rank was forked by its own warm process at the agent's request: `os_parent` is
    that process, `parent` the agent (the guard tells every rank its agent's PID)."""
    agent = int(os.environ.get("DDP_LESSON_AGENT_PID") or os.getppid())
    log(step, pid=os.getpid(), parent=agent, os_parent=os.getppid(), agent_parent=parent_of(agent),
        program=program(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        store=f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
        agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        agent_ports=listening_ports(agent), bad_fork=bad_fork(), **values)


def bad_fork():
    """Whether torch says this process is a fork of one that asked CUDA's runtime: then it
    cannot use a GPU. A warm rank is a fork of a warm process (launcher/warm.py starts it with
    PYTORCH_NVML_BASED_CUDA_CHECK=1, so asking for GPUs asks NVML, not CUDA's runtime)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda._is_in_bad_fork())


def program():
    """This process's command line as the OS shows it: what it was started as. A forked process
    shows the one it was copied from (a warm launch's ranks: the warm process's)."""
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return " ".join(a.decode(errors="replace") for a in f.read().split(b"\0") if a)
    except OSError:
        return " ".join(sys.argv)


def parent_of(pid):
    """The parent's pid of process `pid` (proc(5) stat field 4), None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def listening_ports(pid):
    """The TCP ports process `pid` listens on, read from /proc (a rank imports no psutil):
    the sockets it holds open (/proc/PID/fd) among the listening ones (/proc/net/tcp, tcp6)."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:   # closed since it was listed
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except OSError:
            continue
        for row in rows:   # local_address is HEX_IP:HEX_PORT, st 0A is LISTEN, then the inode
            if len(row) > 9 and row[3] == "0A" and row[9] in inodes:
                ports.add(int(row[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


_statm = (None, None)  # (pid, descriptor): "self" was resolved when it was opened


def rss_mb():
    """This process's resident memory in MB (the mem_mb of a CPU rank's rows)."""
    global _statm
    try:  # the file stays open: pread regenerates it, at a tenth of an open() per step
        if _statm[0] != os.getpid():  # first call, or a forked child holding its parent's file
            _statm = (os.getpid(), os.open("/proc/self/statm", os.O_RDONLY))
        return int(os.pread(_statm[1], 100, 0).split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError, AttributeError):
        import resource  # no /proc (macOS): the peak instead, in bytes there
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class StepTimer:
    """Where this rank's step time goes (see the module docstring).

        timer = metrics.StepTimer(model, opt)       # the DDP model and its optimizer
        loader = timer.timed_loader(loader)         # data_s: time spent in the loader
        metrics.log(step, loss=loss, **timer.lap()) # once per optimizer step

    Public hooks note the moments, and change nothing: a forward pre-hook on the DDP model (runs
    before DDP's forward) and one on the model it wraps (runs after DDP's buffer broadcast,
    torch/nn/parallel/distributed.py forward -> _pre_forward -> _run_ddp_forward); one on each
    parameter, run once backward has added to its gradient (Tensor.register_post_accumulate_grad_hook);
    one on the optimizer, run as its step begins (Optimizer.register_step_pre_hook).

    Two limits:
    - With fp16, GradScaler skips `opt.step()` on a step whose gradients overflowed, unless the
      optimizer is fused (grad_scaler.py `_maybe_opt_step`). The step pre-hook then never runs:
      that step's all-reduce wait counts as compute, unless the script called backward_done().
    - On a GPU, lap() waits for the GPU to reach the step's last mark, once per step. The course
      scripts wait for it each step anyway (.item()); a script that never waits would be slowed."""

    def __init__(self, model, opt):
        import torch
        self._torch = torch
        self.enabled = os.environ.get("DDP_LESSON_STEP_TIMES", "1") != "0"
        self.device = next(model.parameters()).device
        self.cuda = self.device.type == "cuda"
        self._t = time.perf_counter()
        self._data = 0.0
        self._grad = self._end = None   # host times, or CUDA events on a GPU
        self._forward = None             # when DDP's forward was called, until the model's began
        self._syncs = []                 # (start, end) of DDP's buffer broadcast, this step
        if self.enabled:
            inner = getattr(model, "module", None)
            if isinstance(inner, torch.nn.Module):   # a DDP model: time its buffer broadcast
                model.register_forward_pre_hook(self._forward_called)
                inner.register_forward_pre_hook(self._module_begins)
            for p in model.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._grad_ready)
            opt.register_step_pre_hook(self._step_begins)

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = self._torch.cuda.Event(enable_timing=True)
        event.record(self._torch.cuda.current_stream(self.device))
        return event

    def _forward_called(self, module, args):
        self._forward = self._now()

    def _module_begins(self, module, args):
        if self._forward is not None:   # not when a script calls the inner model itself
            self._syncs.append((self._forward, self._now()))
            self._forward = None

    def _grad_ready(self, param):
        self._grad = self._now()   # the last call before the step is backward's last gradient

    def backward_done(self):
        """Call right after loss.backward() returns (after the last micro-batch's): the
        all-reduce wait ends here, so what runs before the step (clipping) is compute."""
        if self.enabled and self._grad is not None and self._end is None:
            self._end = self._now()

    def _step_begins(self, opt, args, kwargs):
        if self._grad is not None and self._end is None:
            self._end = self._now()   # backward has returned: DDP's all-reduce is done

    def timed(self, loader):
        """Yield the loader's batches, adding the time each took to this step's data_s."""
        it = iter(loader)
        self._t = time.perf_counter()  # a new epoch: evaluation time is not a step's
        self._syncs = []               # nor evaluation's buffer broadcasts
        while True:
            t = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            self._data += time.perf_counter() - t
            yield batch

    def timed_loader(self, loader):
        """The loader, timed: each time it is iterated, as timed(loader) does; len() is the
        loader's. Wrap it once, before the epochs: `loader = timer.timed_loader(loader)`."""
        return _TimedLoader(self, loader)

    def lap(self):
        """{data_s, compute_s, wait_s, mem_mb} of the step since the last lap, then restart."""
        if not self.enabled:
            return {}
        pairs = list(self._syncs)
        if self._grad is not None and self._end is not None:
            pairs.append((self._grad, self._end))
        wait = 0.0
        for start, end in pairs:
            if self.cuda:
                end.synchronize()
                wait += start.elapsed_time(end) / 1000
            else:
                wait += end - start
        if self.cuda:
            mem = self._torch.cuda.max_memory_allocated(self.device) / 2**20
            self._torch.cuda.reset_peak_memory_stats(self.device)
        else:
            mem = rss_mb()
        now = time.perf_counter()
        total = now - self._t
        wait = min(max(wait, 0.0), total)
        data = min(self._data, total - wait)
        out = {"data_s": data, "compute_s": max(total - data - wait, 0.0), "wait_s": wait,
               "mem_mb": round(mem, 1)}
        self._t, self._data, self._grad, self._end, self._syncs = now, 0.0, None, None, []
        return out


class _TimedLoader:
    """StepTimer.timed_loader's answer: iterate it every epoch, like the loader it wraps."""

    def __init__(self, timer, loader):
        self.timer, self.loader = timer, loader

    def __iter__(self):
        return self.timer.timed(self.loader)

    def __len__(self):
        return len(self.loader)
