"""A live world of ranks: a real torchrun job whose ranks stay up and run code sent from
the notebook, each in a namespace of its own that persists between calls.

    world = ddp_lesson.world.start()              # 2 CPU ranks (gloo), or one rank per GPU
    world.run("t = torch.tensor([rank + 1.0])")   # every rank runs it
    world.run("dist.all_reduce(t); t.item()")     # -> [RankResult(rank=0, value='3.0', ...), ...]
    world.run("print(t)", ranks=[0])              # only rank 0
    world.stop()

The ranks are ddp_lesson/world_rank.py under launch.start (run directory, parent-death
guard, cleanup: everything a launched script has). They connect back to a listener on
127.0.0.1 that checks a random key (multiprocessing.connection's HMAC handshake); the key
travels in a 0600 file in the run directory, never on a command line or in config.json.
A rank blocked in a collective cannot be interrupted safely, so a call that does not finish
in time leaves the world refusing more work until restart() (which kills it quickly).
"""
import os
import queue
import secrets
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Listener, wait as wait_any
from pathlib import Path
from typing import Optional

from . import checks, launch
from .runs import new_run_dir

RANK_SCRIPT = Path(__file__).with_name("world_rank.py")
KEY_FILE = "world.key"          # the same name as in world_rank.py
START_TIMEOUT_S = 180           # import torch + init_process_group on a busy laptop
DEFAULT_TIMEOUT_S = 120         # a call's limit unless start() or run() says otherwise
INTERRUPT_GRACE_S = 3           # after an Interrupt, how long busy ranks get to give up
EXIT_GRACE_S = 10              # ranks told to leave: torchrun may take seconds to notice


@dataclass
class RankResult:
    rank: int
    stdout: str = ""
    stderr: str = ""
    value: Optional[str] = None   # repr of the cell's last expression, None if there is none
    error: Optional[str] = None   # the traceback from the learner's frames, None if it ran

    @property
    def ok(self):
        return self.error is None


def ranks_text(ranks):
    """[0, 2] -> "ranks 0, 2"; [1] -> "rank 1"."""
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


class World:
    """Handle on a live world; see the module docstring. start() builds one."""

    def __init__(self, nproc=None, gpus=None, cpu=False, timeout=None):
        self.timeout = _check_timeout(timeout)
        self._ask = {"nproc": nproc, "gpus": gpus, "cpu": cpu}
        self._run = None
        self._start()

    # -- state ------------------------------------------------------------------------
    @property
    def run_dir(self):
        return self._run.run_dir

    @property
    def world_size(self):
        return len(self._conns)

    @property
    def backend(self):
        return self._run.config["backend"]

    @property
    def devices(self):
        """{rank: "cpu" | "cuda:0" ...}: each rank's device."""
        return dict(self._devices)

    @property
    def pids(self):
        """{rank: pid} of the rank processes."""
        return dict(self._pids)

    @property
    def address(self):
        """(host, port) the ranks connected to."""
        return self._address

    @property
    def state(self):
        """"ready", "needs restart" (a call timed out, was interrupted or a rank died),
        "stopping" or "stopped"."""
        if self._stopped:
            return "stopped"
        if self._stopping:
            return "stopping"
        if self._broken is None and self._run.done():
            self._broken = f"its processes ended ({self._run.status})"
        return "needs restart" if self._broken else "ready"

    def describe(self):
        where = ("CPU" if self.backend == "gloo" and all(d == "cpu" for d in self._devices.values())
                 else ", ".join(self._devices[r] for r in sorted(self._devices)))
        text = f"{self.world_size} rank(s) on {where} with {self.backend}, run dir {self.run_dir}"
        state = self.state
        if state == "needs restart":
            return f"{text}: needs a restart ({self._broken})."
        return f"{text}: {state}."

    def __repr__(self):
        return f"<World {self.world_size} ranks {self.state} {self.run_dir.name}>"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    # -- running code -----------------------------------------------------------------
    def run(self, code, ranks=None, timeout=None, on_output=None):
        """Run `code` on `ranks` (default: all) and return their RankResults sorted by
        rank. on_output(rank, stream, text) is called with whole lines as they are
        printed. Raises TimeoutError naming the busy ranks when the work does not finish
        within `timeout` seconds; the world then needs restart()."""
        if not isinstance(code, str):
            raise TypeError(f"The code to run must be a string, got {type(code).__name__}.")
        picked = self.pick_ranks(ranks)
        limit = _check_timeout(timeout) or self.timeout or DEFAULT_TIMEOUT_S
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("This world is running another call; wait for it to finish.")
        try:
            self._check_usable()
            self._calls += 1
            call = self._calls
            results = {r: RankResult(r) for r in picked}
            for r in picked:
                self._send(r, ("run", call, code))
            busy = set(picked)
            try:
                self._collect(call, busy, results, on_output, time.monotonic() + limit)
            except KeyboardInterrupt:
                self._interrupt(call, busy, results, on_output)
                raise
            if busy:
                self._broken = (f"a call timed out after {limit:g} s while "
                                f"{ranks_text(busy)} {'was' if len(busy) == 1 else 'were'} busy")
                err = TimeoutError(
                    f"{ranks_text(busy).capitalize()} did not finish within {limit:g} s "
                    f"(waiting in a collective that not every rank entered?); a rank stuck like "
                    f"that cannot be interrupted safely, so the world must restart: "
                    f"world.restart() (in a notebook: %ranks restart).")
                err.busy = sorted(busy)                         # what the magics show
                err.results = [results[r] for r in picked]      # finished ranks' results too
                raise err
            return [results[r] for r in picked]
        finally:
            self._lock.release()

    def pick_ranks(self, ranks):
        """`ranks` (None: all, an int, or a list) as a sorted list; ValueError with one
        sentence for ranks this world does not have."""
        n = self.world_size
        if ranks is None:
            return list(range(n))
        if isinstance(ranks, int) and not isinstance(ranks, bool):
            ranks = [ranks]
        try:
            picked = sorted({int(r) for r in ranks if not isinstance(r, bool) and int(r) == r})
            if len(picked) != len(set(ranks)):
                raise ValueError
        except (TypeError, ValueError):
            raise ValueError(f"Ranks must be whole numbers like [0, 2], got {ranks!r}.") from None
        if not picked:
            raise ValueError("Give at least one rank to run on.")
        bad = [r for r in picked if not 0 <= r < n]
        if bad:
            raise ValueError(f"{ranks_text(bad).capitalize()} {'does' if len(bad) == 1 else 'do'} "
                             f"not exist: this world has ranks 0-{n - 1}.")
        return picked

    def _collect(self, call, busy, results, on_output, deadline):
        by_conn = {self._conns[r]: r for r in busy}
        while busy:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            for conn in wait_any([self._conns[r] for r in busy], timeout=min(left, 0.5)):
                rank = by_conn[conn]
                while rank in busy and conn.poll():
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):
                        self._rank_gone(rank)
                    if msg[0] == "out" and msg[1] == call:
                        res = results[rank]
                        if msg[2] == "stdout":
                            res.stdout += msg[3]
                        else:
                            res.stderr += msg[3]
                        if on_output is not None:
                            on_output(rank, msg[2], msg[3])
                    elif msg[0] == "done" and msg[1] == call:
                        results[rank].value, results[rank].error = msg[2], msg[3]
                        busy.discard(rank)

    def _interrupt(self, call, busy, results, on_output):
        """Interrupt (Ctrl-C, the notebook's stop button): pass it on to the busy ranks.
        One running Python code stops with KeyboardInterrupt; one blocked in a
        collective does not, and then the world needs a restart."""
        for r in busy:
            try:
                os.kill(self._pids[r], signal.SIGINT)
            except OSError:
                pass
        try:
            self._collect(call, busy, results, on_output, time.monotonic() + INTERRUPT_GRACE_S)
        except (KeyboardInterrupt, RuntimeError):
            pass
        if busy:
            self._broken = (f"a call was interrupted while {ranks_text(busy)} "
                            f"{'was' if len(busy) == 1 else 'were'} blocked")

    # -- life cycle -------------------------------------------------------------------
    def restart(self):
        """Stop this world (quickly, even if a rank hangs) and start a fresh one with the
        same devices; names defined before are gone. Returns self."""
        self.stop()
        self._start()
        return self

    def stop(self):
        """End every process of the world; returns the run's result dict."""
        if self._stopped or self._stopping:
            self._run.wait(timeout=EXIT_GRACE_S + 10)  # another thread is stopping it
            return self._run.result
        self._stopping = True
        if not self._run.done():
            if self._broken is None:
                for r in list(self._conns):
                    try:
                        self._conns[r].send(("exit",))
                    except OSError:
                        pass
                self._run.wait(timeout=EXIT_GRACE_S)
            if not self._run.done():
                self._run.stop(grace=1)
        for conn in self._conns.values():
            conn.close()
        self._stopped = True
        return self._run.result

    def _start(self):
        self._conns, self._pids, self._devices = {}, {}, {}
        self._calls, self._broken, self._stopped, self._stopping = 0, None, False, False
        self._lock = threading.Lock()
        key = secrets.token_bytes(32)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        self._address = listener.address
        host, port = self._address
        try:
            self._run = launch.start(RANK_SCRIPT, label="world", run_dir=new_run_dir(name="world"),
                                     env={"DDP_LESSON_WORLD_ADDRESS": f"{host}:{port}"}, **self._ask)
        except BaseException:
            listener.close()
            raise
        _write_private(self._run.run_dir / KEY_FILE, key)
        arrived = queue.Queue()
        closing = threading.Event()
        expected = self._run.config["nproc"]
        pids = set()

        def accept():  # handshake and hello; only ranks of this run get through
            while len(self._conns) < expected and not closing.is_set():
                try:
                    conn = listener.accept()
                    msg = conn.recv() if conn.poll(30) else None
                except Exception:
                    continue  # a wrong key or a broken peer: not one of ours
                if closing.is_set():
                    conn.close()
                    break
                if (not msg or msg[0] != "hello" or msg[2] not in set(self._run.pids())
                        or msg[1] in self._conns):
                    conn.close()
                    continue
                self._conns[msg[1]] = conn
                pids.add(msg[2])
                arrived.put(msg)

        thread = threading.Thread(target=accept, name="ddp-lesson-world-accept", daemon=True)
        thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while len(self._pids) < expected:
                try:
                    _, rank, pid, _, device = arrived.get(timeout=0.05)
                    self._pids[rank], self._devices[rank] = pid, device
                except queue.Empty:
                    if self._run.done():
                        raise RuntimeError(f"The world's ranks ended before they were ready: "
                                           f"{self._run.result.get('message', self._run.status)}")
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"The world's ranks were not ready within "
                                           f"{START_TIMEOUT_S} s; see the logs in {self.run_dir}.")
        except BaseException:
            self._stopped = True
            self._run.stop(grace=1)
            raise
        finally:
            closing.set()
            if thread.is_alive():
                try:  # wake the accept() still waiting
                    Client(self._address, authkey=key).close()
                except OSError:
                    pass
                thread.join(5)
            listener.close()

    # -- inside -----------------------------------------------------------------------
    def _check_usable(self):
        if self._stopped or self._stopping:
            raise RuntimeError("This world was stopped; start a new one (world.restart() or "
                               "%ranks start).")
        if self.state != "ready":
            raise RuntimeError(f"This world cannot run more code: {self._broken}. Restart it: "
                               f"world.restart() (in a notebook: %ranks restart).")

    def _send(self, rank, msg):
        try:
            self._conns[rank].send(msg)
        except OSError:
            self._rank_gone(rank)

    def _rank_gone(self, rank):
        if self._stopping or self._stopped:
            raise RuntimeError("The world was stopped while this call ran.")
        self._run.wait(timeout=3)  # torchrun tears the others down; let it say why
        why = (self._run.result or {}).get("message") or "its process ended"
        self._broken = f"rank {rank}'s process ended"
        raise RuntimeError(f"Rank {rank}'s process ended, so the world cannot go on ({why}). "
                           f"Restart it: world.restart() (in a notebook: %ranks restart).")


def _check_timeout(timeout):
    """Seconds, or None; the launcher's one validator (refuses 0, negatives, nan and inf)."""
    return checks.number("timeout", timeout, 0.001, kind=float, allow_none=True)


def _write_private(path, data):
    """Write `data` to a new file only this user can read, atomically."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def start(nproc=None, gpus=None, cpu=False, timeout=None):
    """Start a live world: `nproc` CPU ranks on gloo (default: DDP_LESSON_NPROC or 2), or
    one rank per GPU on nccl (`gpus` like [0, 1] or "0,1"; all GPUs by default; cpu=True
    forces CPU ranks). `timeout`: seconds a run() call may take unless it says otherwise
    (default 120). Returns when every rank is ready; bad input raises ValueError first."""
    return World(nproc=nproc, gpus=gpus, cpu=cpu, timeout=timeout)
