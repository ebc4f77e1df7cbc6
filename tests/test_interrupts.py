"""ddp_lesson.launcher.interrupts: waiting on an Event from a thread where Ctrl-C can come.

conftest.signal_points delivers SIGINT (raising KeyboardInterrupt) at each point, in turn,
where CPython (3.10-3.13) would; after each, another thread must still be able to set the event.
threading.Event.wait fails this (a lock of its Condition is left taken), which shows the
walk can see the hazard; interrupts.wait_for passes it.
"""
import signal
import threading

from conftest import signal_points
from ddp_lesson.launcher import interrupts


def leaves_the_event_locked(wait):
    """True if an Interrupt at some point of wait(event) left event.set() blocked."""
    steps = signal_points(lambda: wait(threading.Event()), handler=signal.default_int_handler)
    assert steps >= 2
    for step in range(1, steps + 1):
        event = threading.Event()
        signal_points(lambda: wait(event), at=step, handler=signal.default_int_handler)
        setter = threading.Thread(target=event.set, daemon=True)
        setter.start()
        setter.join(2)
        if setter.is_alive():   # blocked for good (a daemon thread: it is left behind)
            return True
    return False


def test_event_wait_can_be_left_holding_its_lock():
    assert leaves_the_event_locked(lambda event: event.wait(0.01))


def test_wait_for_cannot():
    assert not leaves_the_event_locked(lambda event: interrupts.wait_for(event, 0.01))


def test_wait_for_returns_when_set_or_after_the_timeout():
    event = threading.Event()
    assert interrupts.wait_for(event, 0.05) is False
    threading.Timer(0.05, event.set).start()
    assert interrupts.wait_for(event, 5) is True and interrupts.wait_for(event) is True


def test_held_notes_ctrl_c_and_raises_it_at_the_end():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        reached = False
        try:
            with interrupts.Held():
                signal.raise_signal(signal.SIGINT)   # noted, not raised here
                reached = True
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("the held Ctrl-C was not raised when the block ended")
        assert reached
    finally:
        signal.signal(signal.SIGINT, previous)
