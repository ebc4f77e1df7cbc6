"""Ctrl-C on a kernel's main thread, without leaving a lock taken.

CPython raises KeyboardInterrupt at the next check point after a signal: a function's start,
or right after a call returns. threading.Event and queue.Queue take a Condition's lock from
Python code (Condition.__enter__ calls the C lock and returns), so an Interrupt can land just
after that lock was taken and before anything releases it; every later wait, set or put on
that object then blocks for good. The main thread therefore uses these instead:

- Held(): within the block Ctrl-C is noted, not raised; deliver() raises it at a safe point,
  and leaving the block does too.
- wait_for(event, timeout): waits by polling is_set() (which takes no lock) between short
  sleeps; a sleep interrupted by Ctrl-C leaves nothing behind.
"""
import signal
import threading
import time

POLL_S = 0.02


class Held:
    """Within the block, Ctrl-C (SIGINT) is noted instead of raised; deliver() raises it
    at a safe point, and leaving the block does too. Only the main thread takes signals;
    elsewhere this does nothing."""

    def __enter__(self):
        self.pending, self.old = False, None
        if threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGINT, self._note)
        return self

    def _note(self, signum, frame):
        self.pending = True

    def deliver(self):
        if self.pending:
            self.pending = False
            if callable(self.old):
                self.old(signal.SIGINT, None)

    def __exit__(self, *exc):
        if self.old is not None:
            signal.signal(signal.SIGINT, self.old)
            if exc[0] is None:
                self.deliver()


def wait_for(event, timeout=None):
    """event.wait(timeout) that Ctrl-C cannot leave holding the event's lock: True once the
    event is set, False if `timeout` seconds passed first."""
    end = None if timeout is None else time.monotonic() + timeout
    while not event.is_set():
        step = POLL_S if end is None else min(POLL_S, end - time.monotonic())
        if step <= 0:
            return False
        time.sleep(step)
    return True
