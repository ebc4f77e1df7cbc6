"""A live world of ranks: a real torchrun job whose ranks stay up and run code sent from
the notebook, each in a namespace of its own that persists between calls.

    world = ddp_lesson.launcher.world.start()              # 2 CPU ranks (gloo), or one rank per GPU
    world.run("t = torch.tensor([rank + 1.0])")   # every rank runs it
    world.run("dist.all_reduce(t); t.item()")     # -> [RankResult(rank=0, value='3.0', ...), ...]
    world.run("print(t)", ranks=[0])              # only rank 0
    world.stop()

The ranks are ddp_lesson/rank/world_rank.py under launch.start (run directory, parent-death
guard, cleanup: everything a launched script has). They connect back to a Unix socket in a
0700 folder (no other user can connect, whatever network the ranks are in) that also checks
a random key (multiprocessing.connection's HMAC handshake); the key travels in a 0600 file in
the run directory, never on a command line or in config.json. A rank turned away at the door
(too many handshakes at once) knocks again until the start's timeout.
A rank blocked in a collective cannot be interrupted safely, so a call that does not finish
in time leaves the world refusing more work until restart() (which kills it quickly).
"""
import os
import pickle
import queue
import secrets
import select
import shutil
import signal
import socket
import struct
import threading
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge, wait as wait_any
from pathlib import Path
from typing import Optional

from . import devices, interrupts, isolation, launch, validate
from ..rank import rundir
from ..rank.world_messages import ADDRESS_ENV, START_TIMEOUT_S, Done, Exit, Gone, Out, Run, valid_hello
from .spec import Spec

RANK_SCRIPT = Path(__file__).resolve().parents[1] / "rank" / "world_rank.py"
DEFAULT_TIMEOUT_S = 120         # a call's limit unless start() or run() says otherwise
INTERRUPT_GRACE_S = 3           # after an Interrupt, how long busy ranks get to give up
EXIT_GRACE_S = 10              # ranks told to leave: torchrun may take seconds to notice
HANDSHAKE_S = 5                 # a peer must prove the key and say hello within this
MAX_HANDSHAKES = 32             # peers in their handshake at once; more are turned away
INBOX_BATCHES = 8               # batches (<= BATCH_BYTES each) read ahead before ranks wait
BATCH_BYTES = 1 << 20
KEEP_CHARS = 8 << 20            # a call's output kept per rank and stream; the rest is counted
WAIT_STEP_S = 0.1               # how often a waiting call looks at its deadline and Ctrl-C


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
    """Handle on a live world; see the module docstring. start() builds one.

    One lock (`_life`) makes every change of state atomic: start, stop and restart never
    interleave, so no process is ever left without a world that owns it. A call (run())
    holds it only to check and send, so Stop works while a cell runs."""

    def __init__(self, nproc=None, gpus=None, cpu=False, timeout=None):
        self.timeout = _check_timeout(timeout)
        # what every start launches (bad devices are refused here, before any); each start
        # adds its own door's address and key
        self._spec = Spec(RANK_SCRIPT, devices.Request(nproc, gpus, cpu), label="world")
        self._life = threading.RLock()
        self._call = threading.Lock()        # one run() at a time
        self._stop_asked = False   # a stop is waiting for the lock: starts give up (a plain flag: no lock)
        self._run, self._inbox, self._address = None, None, None
        self._conns, self._pids, self._devices = {}, {}, {}
        self._calls, self._broken = 0, None
        self._stopped, self._stopping, self._starting = True, False, False
        with self._life:
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
        """The path of the Unix socket the ranks connected to (gone once they are in)."""
        return self._address

    @property
    def state(self):
        """"ready", "needs restart" (a call timed out, was interrupted or a rank died),
        "starting", "stopping" or "stopped"."""
        if self._starting:
            return "starting"
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
        within `timeout` seconds, whatever the ranks print; the world then needs restart().
        An Interrupt (Ctrl-C) returns within INTERRUPT_GRACE_S (plus a moment)."""
        if not isinstance(code, str):
            raise TypeError(f"The code to run must be a string, got {type(code).__name__}.")
        picked = self.pick_ranks(ranks)
        limit = _check_timeout(timeout) or self.timeout or DEFAULT_TIMEOUT_S
        # Ctrl-C is held from before the call lock is taken until it is given back: one
        # landing between taking it and the try below would leave it taken for good
        with interrupts.Held() as held:
            if not self._call.acquire(blocking=False):
                raise RuntimeError("This world is running another call; wait for it to finish.")
            try:
                with self._life:
                    self._check_usable()
                    self._calls += 1
                    call = self._calls
                    for r in picked:
                        self._send(r, Run(call, code))
                reply = _Reply(picked)
                try:
                    self._collect(call, reply, on_output, time.monotonic() + limit, held)
                except KeyboardInterrupt:
                    self._interrupt(call, reply, held)
                    raise
                if reply.busy:
                    self._broken = (f"a call timed out after {limit:g} s while "
                                    f"{ranks_text(reply.busy)} {_was(reply.busy)} busy")
                    err = TimeoutError(
                        f"{ranks_text(reply.busy).capitalize()} did not finish within {limit:g} s "
                        f"(waiting in a collective that not every rank entered?); a rank stuck "
                        f"like that cannot be interrupted safely, so the world must restart: "
                        f"world.restart() (in a notebook: %ranks restart).")
                    err.busy = sorted(reply.busy)      # what the magics show
                    err.results = reply.results()      # finished ranks' results too
                    raise err
            finally:
                self._call.release()
        return reply.results()

    def pick_ranks(self, ranks):
        """`ranks` (None: all, an int, a range or a list) as a sorted list; ValueError with
        one short sentence for ranks this world does not have."""
        n = self.world_size
        if ranks is None:
            return list(range(n))
        if isinstance(ranks, int) and not isinstance(ranks, bool):
            ranks = [ranks]
        if isinstance(ranks, range) and ranks:    # checked by its ends, never spelled out
            lo, hi = min(ranks[0], ranks[-1]), max(ranks[0], ranks[-1])
            if 0 <= lo and hi < n:
                return sorted(ranks)
            raise ValueError(f"Ranks {lo}-{hi} include ranks that do not exist: this world "
                             f"has ranks 0-{n - 1}.")
        try:
            picked = sorted({int(r) for r in ranks if not isinstance(r, bool) and int(r) == r})
            if len(picked) != len(set(ranks)):
                raise ValueError
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"Ranks must be whole numbers like [0, 2], got "
                             f"{_short(repr(ranks))}.") from None
        if not picked:
            raise ValueError("Give at least one rank to run on.")
        bad = [r for r in picked if not 0 <= r < n]
        if bad:
            shown = ranks_text(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            raise ValueError(f"{shown.capitalize()} {'does' if len(bad) == 1 else 'do'} "
                             f"not exist: this world has ranks 0-{n - 1}.")
        return picked

    def _collect(self, call, reply, on_output, deadline, held):
        """Take the ranks' messages until every busy rank is done or the deadline passes.
        Ctrl-C is held while a message is handled and raised between messages."""
        while reply.busy:
            held.deliver()
            if self._stopping or self._stopped:
                raise RuntimeError("The world was stopped while this call ran.")
            left = deadline - time.monotonic()
            if left <= 0:
                return
            got = self._inbox.get(min(left, WAIT_STEP_S))
            if got is None:
                continue
            rank, batch = got
            for msg in batch:
                if isinstance(msg, Gone):
                    self._rank_gone(rank)
                elif isinstance(msg, (Out, Done)) and msg.call == call and rank in reply.busy:
                    if isinstance(msg, Out) and msg.stream in ("stdout", "stderr"):
                        reply.add(rank, msg.stream, msg.text)
                        if on_output is not None:
                            on_output(rank, msg.stream, msg.text)
                    elif isinstance(msg, Done):
                        reply.done[rank] = (msg.value, msg.error)
                        reply.busy.discard(rank)

    def _interrupt(self, call, reply, held):
        """Interrupt (Ctrl-C, the notebook's stop button): pass it on to the busy ranks.
        One running Python code stops with KeyboardInterrupt; one blocked in a
        collective does not, and then the world needs a restart. Output that arrives
        meanwhile is kept but not shown (showing it is what could take long)."""
        for r in reply.busy:
            try:
                os.kill(self._pids[r], signal.SIGINT)
            except OSError:
                pass
        try:
            self._collect(call, reply, None, time.monotonic() + INTERRUPT_GRACE_S, held)
        except (KeyboardInterrupt, RuntimeError):
            pass   # a second Ctrl-C gives up waiting; a rank that ended was already noted
        if reply.busy:
            self._broken = (f"a call was interrupted while {ranks_text(reply.busy)} "
                            f"{_was(reply.busy)} blocked")

    # -- life cycle -------------------------------------------------------------------
    def restart(self):
        """Stop this world (quickly, even if a rank hangs) and start a fresh one with the
        same devices; names defined before are gone. Returns self. A stop() from another
        thread meanwhile wins: the world ends stopped, and this raises RuntimeError."""
        with self._life:
            self._stop_locked()
            if self._stop_asked:
                raise RuntimeError("The world was stopped while it restarted.")
            self._start()
        return self

    def stop(self):
        """End every process of the world; returns the run's result dict. Safe from any
        thread, during a call or a restart (it waits for the restart, which gives up)."""
        self._stop_asked = True
        try:
            with self._life:
                self._stop_locked()
                return self._run.result if self._run is not None else None
        finally:
            self._stop_asked = False

    def _stop_locked(self):
        if self._stopped:
            return
        self._stopping = True
        try:
            if not self._run.done():
                if self._broken is None and not self._call.locked():
                    for r in list(self._conns):
                        self._send_quietly(r, Exit())
                    self._run.wait(timeout=EXIT_GRACE_S)
                if not self._run.done():
                    self._run.stop(grace=1)
        finally:
            self._inbox.close()
            for conn in self._conns.values():
                conn.close()
            self._stopped, self._stopping = True, False

    def _start(self):
        """Launch the ranks and let them in; the world changes only once all are in."""
        self._starting = True
        try:
            key = secrets.token_bytes(32)
            with _Door(key) as door:
                self._address = door.address
                run = launch.run(replace(self._spec, env={ADDRESS_ENV: door.address},
                                         private_files={rundir.WORLD_KEY: key}),
                                 run_dir=rundir.new_path(name="world"))
                try:
                    hellos = self._gather(door, run)
                except BaseException:
                    run.stop(grace=1)
                    raise
            self._adopt(run, hellos)
        finally:
            self._starting = False

    def _gather(self, door, run):
        """{rank: (conn, hello)} once every rank of `run` said hello; RuntimeError with
        one sentence if the ranks end first, take too long, or a stop() is waiting."""
        expected, arrived = run.config["nproc"], {}
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while len(arrived) < expected:
                if self._stop_asked:
                    raise RuntimeError("The world was stopped while it started.")
                if run.done():
                    raise RuntimeError(f"The world's ranks ended before they were ready: "
                                       f"{run.result.get('message', run.status)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"The world's ranks were not ready within "
                                       f"{START_TIMEOUT_S} s; see the logs in {run.run_dir}.")
                door.admit(0.05)
                for conn, hello in door.arrivals():
                    if hello.rank in arrived or hello.pid not in set(run.pids()):
                        conn.close()   # someone with the key, but not a rank of this run
                    else:
                        arrived[hello.rank] = (conn, hello)
        except BaseException:
            for conn, _ in arrived.values():
                conn.close()
            raise
        return arrived

    def _adopt(self, run, hellos):
        self._run = run
        self._conns = {r: conn for r, (conn, _) in hellos.items()}
        self._pids = {r: hello.pid for r, (_, hello) in hellos.items()}
        self._devices = {r: hello.device for r, (_, hello) in hellos.items()}
        self._inbox = _Inbox(self._conns)
        self._broken, self._stopped, self._stopping = None, False, False   # call ids go on

    # -- inside -----------------------------------------------------------------------
    def _check_usable(self):
        state = self.state
        if state in ("stopped", "stopping", "starting"):
            raise RuntimeError("This world was stopped; start a new one (world.restart() or "
                               "%ranks start).")
        if state != "ready":
            raise RuntimeError(f"This world cannot run more code: {self._broken}. Restart it: "
                               f"world.restart() (in a notebook: %ranks restart).")

    def _send(self, rank, msg):
        if not self._send_quietly(rank, msg):
            self._rank_gone(rank)

    def _send_quietly(self, rank, msg):
        with interrupts.Held():   # a message is sent whole or not at all
            try:
                self._conns[rank].send(msg)
                return True
            except OSError:
                return False

    def _rank_gone(self, rank):
        if self._stopping or self._stopped:
            raise RuntimeError("The world was stopped while this call ran.")
        self._run.wait(timeout=3)  # torchrun tears the others down; let it say why
        why = (self._run.result or {}).get("message") or "its process ended"
        self._broken = f"rank {rank}'s process ended"
        raise RuntimeError(f"Rank {rank}'s process ended, so the world cannot go on ({why}). "
                           f"Restart it: world.restart() (in a notebook: %ranks restart).")


class _Reply:
    """What the ranks of one call sent so far. Text is kept as a list of pieces, joined
    once at the end: printing many short lines costs the same as one long one."""

    def __init__(self, ranks):
        self.ranks = list(ranks)
        self.busy = set(ranks)
        self.texts = {r: {"stdout": [], "stderr": []} for r in ranks}
        self.kept = {(r, s): 0 for r in ranks for s in ("stdout", "stderr")}
        self.dropped = dict.fromkeys(self.kept, 0)
        self.done = {}

    def add(self, rank, stream, text):
        # a rank printing without end must not fill the kernel's memory: keep the first
        # KEEP_CHARS of each stream, count the rest
        room = KEEP_CHARS - self.kept[rank, stream]
        if room > 0:
            self.texts[rank][stream].append(text[:room])
            self.kept[rank, stream] += min(len(text), room)
        self.dropped[rank, stream] += max(0, len(text) - max(room, 0))

    def _text(self, rank, stream):
        text = "".join(self.texts[rank][stream])
        dropped = self.dropped[rank, stream]
        return text + (f"\n[... {dropped:,} more characters not kept: a call keeps the first "
                       f"{KEEP_CHARS:,} of each rank's {stream}]\n" if dropped else "")

    def results(self):
        out = []
        for r in self.ranks:
            value, error = self.done.get(r, (None, None))
            out.append(RankResult(r, self._text(r, "stdout"), self._text(r, "stderr"), value, error))
        return out


class _Inbox:
    """Every rank's messages, read on a thread of its own: the kernel's main thread only
    waits on a queue, with a deadline, so neither Ctrl-C nor a rank that stops halfway
    through a message can leave it stuck or out of step. The queue is bounded, so a
    rank printing faster than the kernel reads waits (in its print) instead of filling
    the kernel's memory. A rank's end arrives as Gone()."""

    def __init__(self, conns):
        self.queue = queue.Queue(maxsize=INBOX_BATCHES)
        self.closing = False   # set by the kernel's main thread: a plain flag, no lock
        self.thread = threading.Thread(target=self._read, args=({c: r for r, c in conns.items()},),
                                       name="ddp-lesson-world-inbox", daemon=True)
        self.thread.start()

    def get(self, timeout):
        """(rank, [message, ...]) or None after `timeout` seconds."""
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self):
        self.closing = True
        self.thread.join(1)

    def _read(self, ranks):
        while ranks and not self.closing:
            try:
                ready = wait_any(list(ranks), timeout=0.2)
            except (OSError, ValueError):
                return   # the connections were closed under us: the world stopped
            for conn in ready:
                batch, size = [], 0
                try:
                    while size < BATCH_BYTES and len(batch) < 1000 and conn.poll():
                        data = conn.recv_bytes()
                        size += len(data)
                        batch.append(pickle.loads(data))
                except Exception:  # EOF, a closed or broken connection, a garbled message
                    batch.append(Gone())
                    self._put(ranks.pop(conn), batch)
                    continue
                self._put(ranks[conn], batch)

    def _put(self, rank, batch):
        while not self.closing:
            try:
                self.queue.put((rank, batch), timeout=0.2)
                return
            except queue.Full:
                pass


class _Door:
    """The listener the ranks connect back to: a Unix socket in a new 0700 folder, so only
    this user's processes can connect. Each peer's key handshake (multiprocessing.connection's
    HMAC challenge) and hello still run on a thread of their own with a deadline per read: a
    silent or slow peer costs the ranks nothing and is dropped after HANDSHAKE_S. Closing it
    ends every handshake still going and removes the folder."""

    def __init__(self, key):
        self.key = key
        self.folder = isolation.private_dir("ddp-lesson-door-")
        self.address = os.path.join(self.folder, "door")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.address)
        self.sock.listen(64)
        self.lock = threading.Lock()
        self.pending, self.ready, self.closed = set(), [], False

    def __enter__(self):
        return self

    def admit(self, wait_s):
        """Accept a peer that knocked within `wait_s` seconds and start its handshake."""
        if not select.select([self.sock], [], [], wait_s)[0]:
            return
        try:
            peer, _ = self.sock.accept()
        except OSError:
            return
        with self.lock:
            if self.closed or len(self.pending) >= MAX_HANDSHAKES:
                peer.close()
                return
            self.pending.add(peer)
        threading.Thread(target=self._handshake, args=(peer,), daemon=True,
                         name="ddp-lesson-world-handshake").start()

    def arrivals(self):
        """[(conn, hello), ...] of the peers that passed since the last call."""
        with self.lock:
            got, self.ready = self.ready, []
        return got

    def _handshake(self, peer):
        conn = None
        try:
            _read_deadline(peer, HANDSHAKE_S)
            conn = Connection(os.dup(peer.fileno()))
            deliver_challenge(conn, self.key)
            answer_challenge(conn, self.key)
            hello = conn.recv() if conn.poll(HANDSHAKE_S) else None
            _read_deadline(peer, 0)   # from now on the ranks may be quiet for long
            if valid_hello(hello):
                with self.lock:
                    if not self.closed:
                        self.ready.append((conn, hello))
                        conn = None
        except Exception:
            pass   # a wrong key, a silent or broken peer: not one of ours
        finally:
            with self.lock:
                self.pending.discard(peer)
            peer.close()
            if conn is not None:
                conn.close()

    def __exit__(self, *exc):
        with self.lock:
            self.closed = True
            for peer in self.pending:   # wakes a handshake waiting to read
                try:
                    peer.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            left, self.ready = self.ready, []
        for conn, _ in left:
            conn.close()
        self.sock.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def _read_deadline(sock, seconds):
    """Reads and writes on `sock` (and its duplicates) fail after `seconds`; 0: never."""
    t = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, t)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, t)


def _was(ranks):
    return "was" if len(ranks) == 1 else "were"


def _short(text, limit=80):
    return text if len(text) <= limit else text[:limit - 5] + " ...]"


def _check_timeout(timeout):
    """Seconds, or None; the launcher's one validator (refuses 0, negatives, nan and inf)."""
    return validate.number("timeout", timeout, 0.001, kind=float, allow_none=True)


def start(nproc=None, gpus=None, cpu=False, timeout=None):
    """Start a live world: `nproc` CPU ranks on gloo (default: DDP_LESSON_NPROC, else 2; 1
    when only one core is usable), or one rank per GPU on nccl (`gpus` like [0, 1] or "0,1";
    by default every free GPU where there are two or more, devices.default_gpus; cpu=True
    forces CPU ranks). `timeout`: seconds a run() call may take unless it says otherwise
    (default 120). Returns when every rank is ready; bad input raises ValueError first."""
    return World(nproc=nproc, gpus=gpus, cpu=cpu, timeout=timeout)
