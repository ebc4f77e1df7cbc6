"""Notebook 03b's three check scripts in one launch, on the same ranks, one after the other:
ddp_equivalence.py, ddp_checks.py, find_unused.py. Each writes its JSON verdict into the
run directory, as it does when it runs alone (torchrun ... ddp_checks.py). One launch instead
of three: every process starts Python and imports torch once, not three times.
"""
import os
import sys

import torch
import torch.distributed as dist

import ddp_checks        # siblings in ddp_lesson/rank/scripts/checks (the launcher puts that folder on sys.path)
import ddp_equivalence
import find_unused


def main():
    dist.init_process_group("gloo")   # CPU ranks: the notebook starts this with check(), always on CPU
    ddp_equivalence.check()
    ddp_checks.check(torch.device("cpu"), None)
    find_unused.check()               # last: it leaves a DDP object that cannot be torn down
    sys.stdout.flush()                # (see find_unused.main): leave without destructors
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
