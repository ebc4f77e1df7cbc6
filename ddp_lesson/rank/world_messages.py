"""The live world's messages between the kernel (world.py) and its ranks (world_rank.py), in
one place: named tuples, pickled over the authenticated connection. Standard library only,
since the ranks import it.

    kernel -> rank: Run(call, code), Exit()
    rank -> kernel: Hello(rank, pid, world_size, device)   once, right after connecting
                    Out(call, stream, text)                 what a cell printed ("stdout" or "stderr")
                    Done(call, value, error)                the cell's value as repr, or its traceback
    Gone() is the kernel's own note in its inbox that a rank's connection ended.
"""
from typing import NamedTuple, Optional

ADDRESS_ENV = "DDP_LESSON_WORLD_ADDRESS"   # the Unix socket where a rank connects back to the kernel
START_TIMEOUT_S = 180   # a world's start: import torch + init_process_group on a busy laptop


class Run(NamedTuple):
    call: int
    code: str


class Exit(NamedTuple):
    pass


class Hello(NamedTuple):
    rank: int
    pid: int
    world_size: int
    device: str


class Out(NamedTuple):
    call: int
    stream: str
    text: str


class Done(NamedTuple):
    call: int
    value: Optional[str]
    error: Optional[str]


class Gone(NamedTuple):
    pass


def valid_hello(msg):
    """True for a Hello whose rank and pid are integers: what the kernel admits."""
    return isinstance(msg, Hello) and isinstance(msg.rank, int) and isinstance(msg.pid, int)
