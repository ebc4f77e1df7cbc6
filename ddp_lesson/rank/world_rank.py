"""One rank of a live world (ddp_lesson.launcher.world): what torchrun runs for each rank.

It joins the process group (gloo on CPU; nccl on GPUs, each rank on its own device),
connects back to the kernel over an authenticated loopback connection and then runs the
code the kernel sends, in one namespace that lives as long as the rank, streaming what it
prints. The messages are world_messages.py's.
"""
import _thread
import ast
import builtins
import io
import linecache
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Client

from ddp_lesson.rank import rundir   # standard library only, like this file
from ddp_lesson.rank.world_messages import ADDRESS_ENV, START_TIMEOUT_S, Done, Exit, Hello, Out

GATHER_S = 0.02          # printed lines reach the kernel within this (one message)
GATHER_BYTES = 1 << 16   # or sooner, once this much is waiting


def _read_key(run_dir):
    # launch.start wrote it (mode 0600) before it started torchrun: no wait
    path = rundir.world_key(run_dir)
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise RuntimeError(f"No key file {path}: this rank was not started by a live world.") from None


class Channel:
    """The connection to the kernel; several threads may print at once. A message goes
    out whole: an Interrupt that comes while the cell's thread sends one is raised
    right after it (a message cut in half would leave the kernel out of step)."""

    def __init__(self, conn):
        self.conn = conn
        self.lock = threading.Lock()
        self.call = None       # the id of the cell running now, None between cells
        self.in_cell = False   # the learner's code is running (only then does Ctrl-C reach it)
        self.sending = False   # the main thread is inside conn.send
        self.held = False      # an Interrupt came while it was

    def send(self, msg):
        main = threading.current_thread() is threading.main_thread()
        with self.lock:
            self.sending = main
            try:
                self.conn.send(msg)
            finally:
                self.sending = False
        if main and self.held and self.in_cell:
            self.held = False
            raise KeyboardInterrupt

    def on_interrupt(self, signum, frame):
        """The rank's SIGINT handler, installed once: an Interrupt reaches the learner's code
        (after the message being sent, if one is) and is ignored between cells. Plain flags,
        not a handler switched per cell: signal.signal() runs a pending signal's old handler
        first, so a switch back could be cut short and leave a handler that kills the rank."""
        if not self.in_cell:
            return
        if self.sending:
            self.held = True
        else:
            raise KeyboardInterrupt


class Stream(io.TextIOBase):
    """sys.stdout / sys.stderr of a rank: during a cell, whole lines go to the kernel as
    they are printed; between cells (a thread still printing) to the rank's log file.
    What bypasses Python (a subprocess, C code writing to fd 1) goes to the log file too.

    Lines are gathered for up to GATHER_S (or GATHER_BYTES) and sent as one message by a
    thread of the stream's own: a cell printing many short lines then costs the kernel a
    few messages, not one per line, and its Interrupt finds little queued before "done"."""

    def __init__(self, channel, name, fallback):
        super().__init__()
        self.channel, self.name, self.fallback = channel, name, fallback
        self.parts, self.size = [], 0   # text not sent yet, in pieces (joined once: linear)
        self.lock = threading.Lock()    # held from taking the text until it is sent: in order
        # Lines waiting: a bare lock, released by write() and taken back by the gatherer. Not
        # threading.Event: its set() runs Python code under a lock of its own, and an
        # Interrupt landing there leaves that lock held, so the rank's next print hangs.
        self.waiting = _thread.allocate_lock()
        self.waiting.acquire()
        threading.Thread(target=self._gatherer, daemon=True, name=f"ddp-lesson-{name}").start()

    def write(self, text):
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if self.channel.call is None:
            return self.fallback.write(text)
        with self.lock:
            self.parts.append(text)
            self.size += len(text)
            full = self.size >= GATHER_BYTES
            if full:   # a line of over 1 MB goes out in pieces (no text is joined twice)
                self._send_lines(everything=self.size >= 16 * GATHER_BYTES)
        if not full and "\n" in text:
            try:
                self.waiting.release()   # one C call: an Interrupt lands before or after it
            except RuntimeError:
                pass                     # already released: the gatherer is on its way
        return len(text)

    def flush(self):
        with self.lock:
            self._send_lines(everything=True)
        self.fallback.flush()

    def _gatherer(self):
        while True:
            self.waiting.acquire()
            time.sleep(GATHER_S)
            with self.lock:
                self._send_lines()

    def _send_lines(self, everything=False):
        """Send the whole lines written so far (everything: the rest too); under self.lock."""
        text = "".join(self.parts)
        cut = len(text) if everything else text.rfind("\n") + 1
        rest = text[cut:]
        self.parts, self.size = ([rest] if rest else []), len(rest)
        call = self.channel.call
        if cut and call is not None:
            self.channel.send(Out(call, self.name, text[:cut]))

    def isatty(self):
        return False

    def writable(self):
        return True

    def fileno(self):
        return self.fallback.fileno()

    @property
    def encoding(self):
        return "utf-8"


def _learner_traceback(e):
    """The traceback from the cell's own frames on (this file's frames are plumbing)."""
    if isinstance(e, SyntaxError):
        return "".join(traceback.format_exception_only(type(e), e))
    tb = e.__traceback__
    here = _learner_traceback.__code__.co_filename   # the file that ran (a launch names __file__ the original)
    while tb is not None and tb.tb_frame.f_code.co_filename == here:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(e), e, tb))


def run_cell(code, namespace, filename, channel):
    """Run `code` like a notebook cell: everything, then the value of a trailing
    expression. Returns (repr of that value or None, traceback text or None). An
    Interrupt reaches the code only while channel.in_cell is set (Channel.on_interrupt)."""
    try:
        tree = ast.parse(code, filename=filename)
        # register the source so tracebacks can show the cell's lines
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        channel.in_cell = True
        try:
            exec(compile(tree, filename, "exec"), namespace)
            value = None
            if last is not None:
                value = eval(compile(ast.Expression(last.value), filename, "eval"), namespace)
        finally:
            channel.in_cell = False
        return (None if value is None else repr(value)), None
    except BaseException as e:  # the rank lives on; the learner sees the traceback
        return None, _learner_traceback(e)


def knock(address, key, deadline_s=START_TIMEOUT_S):
    """The kernel's connection, through its door (a Unix socket). A door busy with other
    handshakes turns a rank away (it closes the connection): knock again, until the start's
    timeout."""
    end, pause = time.monotonic() + deadline_s, 0.05
    while True:
        try:
            return Client(address, family="AF_UNIX", authkey=key)
        except (EOFError, ConnectionError) as e:
            if time.monotonic() + pause > end:
                raise RuntimeError(f"The kernel's door turned this rank away until the start's "
                                   f"timeout ({deadline_s} s): {type(e).__name__}") from None
            time.sleep(pause)
            pause = min(pause * 2, 1.0)


def main():
    import torch
    import torch.distributed as dist

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only a running cell takes an Interrupt (below)
    # Cells import from the kernel's working folder, as in the notebook (the launcher put
    # this copy's folder and the package folder on the path instead).
    pkg = os.environ.get("DDP_LESSON_SCRIPT_DIR")
    sys.path[:] = [p for p in sys.path if p != pkg]
    sys.path[0] = os.getcwd()

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    backend = os.environ.get("DDP_LESSON_BACKEND", "gloo")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group(backend, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group(backend)

    key = _read_key(rundir.from_env())
    channel = Channel(knock(os.environ[ADDRESS_ENV], key))
    del key
    signal.signal(signal.SIGINT, channel.on_interrupt)   # ignores Ctrl-C until a cell runs
    channel.send(Hello(rank, os.getpid(), world_size, str(device)))
    out, err = Stream(channel, "stdout", sys.__stdout__), Stream(channel, "stderr", sys.__stderr__)

    namespace = {"__name__": "__main__", "__builtins__": builtins, "torch": torch,
                 "dist": dist, "rank": rank, "world_size": world_size, "device": device}
    cells = 0
    while True:
        try:
            msg = channel.conn.recv()
        except (EOFError, OSError):  # the kernel is gone: so is this world
            break
        if isinstance(msg, Exit):
            break
        call, code = msg.call, msg.code
        cells += 1
        sys.stdout, sys.stderr = out, err   # each cell starts with them (one may replace them)
        channel.call, channel.held = call, False
        value, error = run_cell(code, namespace, f"<rank {rank} cell {cells}>", channel)
        channel.held = False
        sys.stdout, sys.stderr = out, err
        out.flush()
        err.flush()
        channel.call = None
        channel.send(Done(call, value, error))
    channel.conn.close()


if __name__ == "__main__":
    main()
