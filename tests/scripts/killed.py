"""Rank 1 is killed by SIGKILL (what the out-of-memory killer does); rank 0 waits in a
collective."""
import os
import signal
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
t = torch.ones(1)
dist.all_reduce(t)
