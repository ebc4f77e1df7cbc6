"""The one place that turns a number someone typed (a flag, a widget, a keyword) into a
number, or refuses it with one sentence before anything starts."""
import math
import os

from .. import BadInput

MAX_CPU_RANKS_ENV = "DDP_LESSON_MAX_CPU_RANKS"


def number(name, value, minimum, kind=int, allow_none=False):
    """`value` as an int (kind=int: whole numbers only, no bools) or a finite float, at
    least `minimum`; BadInput naming `name` otherwise."""
    if value is None and allow_none:
        return None
    what = "a whole number" if kind is int else "a number"
    if isinstance(value, bool):
        raise BadInput(f"{name} must be {what}, got {value!r}.")
    try:
        number = kind(str(value).strip()) if isinstance(value, str) else kind(value)
        if kind is int and not isinstance(value, int) and str(value).strip() != str(number):
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise BadInput(f"{name} must be {what}, got {value!r}.") from None
    if not math.isfinite(number):
        raise BadInput(f"{name} must be a finite number, got {value!r}.")
    if number < minimum:
        raise BadInput(f"{name} must be at least {minimum:g}, got {number:g}.")
    return number


def max_cpu_ranks(cores):
    """CPU ranks allowed without asking on purpose: max(8, 4 x cores), or the number in
    DDP_LESSON_MAX_CPU_RANKS."""
    setting = os.environ.get(MAX_CPU_RANKS_ENV)
    if setting:
        return number(MAX_CPU_RANKS_ENV, setting, 1)
    return max(8, 4 * cores)


def cpu_ranks(nproc, cores):
    """Refuse CPU rank counts far beyond the machine, saying how to go further on purpose."""
    limit = max_cpu_ranks(cores)
    if nproc > limit:
        raise BadInput(f"--nproc {nproc} is far more CPU processes than this machine's {cores} "
                       f"core(s) can run (at most {limit} here); to go further on purpose, set "
                       f"{MAX_CPU_RANKS_ENV}={nproc}.")
    return nproc


def bounded(name, value, minimum, maximum, kind=int):
    """number(name, value, minimum, kind), and at most `maximum`; BadInput otherwise."""
    n = number(name, value, minimum, kind=kind)
    if n > maximum:
        raise BadInput(f"{name} must be at most {maximum}, got {value}.")
    return n
