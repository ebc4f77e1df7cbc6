"""A rank of the live world, in this process: its print stream (ddp_lesson.rank.world_rank.Stream)
must survive an Interrupt that lands anywhere inside a print.

An Interrupt (SIGINT) raises KeyboardInterrupt at whatever Python line the cell's thread is
on. If that line was inside a lock's critical section that Python code entered, the lock
stayed held and the rank's next print hung; found under load by test_world_abuse. Here
the Interrupt is put, in turn, on every point of a print where CPython (3.10-3.13) would deliver
it (conftest.signal_points), so the check does not depend on timing.
"""
import io
import signal
import threading
import time

import pytest

from conftest import signal_points
from ddp_lesson.rank import world_rank


class Connection:
    """Stands in for the connection to the kernel: keeps what the rank sends."""

    def __init__(self):
        self.sent = []

    def send(self, msg):
        self.sent.append(msg)


def stream_to_kernel():
    conn = Connection()
    channel = world_rank.Channel(conn)
    channel.call, channel.in_cell = 1, True   # a cell is running: lines go to the kernel
    return world_rank.Stream(channel, "stdout", io.StringIO()), conn


def printed(stream, text, flush):
    stream.write(text)
    if flush:   # print(..., flush=True)
        stream.flush()


@pytest.mark.parametrize("flush", [False, True], ids=["print", "print-flush"])
def test_an_interrupt_anywhere_in_a_print_leaves_the_next_print_working(flush):
    probe, _ = stream_to_kernel()
    steps = signal_points(lambda: printed(probe, "first\n", flush))
    assert steps >= 4   # the print itself has some: the trace does see it
    for step in range(1, steps + 1):
        stream, conn = stream_to_kernel()
        # what SIGINT does in a rank during a cell: the rank's handler (it holds the
        # Interrupt while a message is being sent, and raises it otherwise)
        signal_points(lambda: printed(stream, "first\n", flush), at=step,
                      handler=stream.channel.on_interrupt)
        after = threading.Thread(target=printed, args=(stream, "second\n", flush), daemon=True)
        after.start()
        after.join(5)
        assert not after.is_alive(), f"an Interrupt at step {step} of {steps} left print stuck"
        end = time.monotonic() + 5
        while not any("second" in m[-1] for m in conn.sent) and time.monotonic() < end:
            time.sleep(0.01)
        assert any("second" in m[-1] for m in conn.sent), \
            f"an Interrupt at step {step} of {steps}: the next line never reached the kernel"


def test_an_interrupt_anywhere_in_a_cell_ends_it_and_the_rank_then_ignores_ctrl_c():
    """run_cell with an Interrupt at each point: the cell ends (with a KeyboardInterrupt
    traceback where it was cut), run_cell itself never raises, and afterwards Ctrl-C is
    ignored, as it must be between cells (a rank that raised there would die)."""
    channel = world_rank.Channel(Connection())
    code = "x = sum(range(10))\nx"
    steps = signal_points(lambda: world_rank.run_cell(code, {}, "<cell>", channel))
    assert steps >= 4
    for step in range(1, steps + 1):
        got = []
        signal_points(lambda: got.append(world_rank.run_cell(code, {}, "<cell>", channel)),
                      at=step, handler=channel.on_interrupt)
        if got:   # the point may fall after run_cell returned (in this test's lambda)
            value, error = got[0]
            assert value == "45" or "KeyboardInterrupt" in error, (step, value, error)
        assert not channel.in_cell, step
        channel.on_interrupt(signal.SIGINT, None)   # between cells: ignored, no exception
