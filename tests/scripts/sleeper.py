"""Two ranks join a gloo process group, say "ready" and then sleep until they are ended.
With --ignore-term they ignore SIGTERM (a stubborn script), so only SIGKILL ends them."""
import signal
import sys
import time

import torch.distributed as dist

if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
dist.init_process_group("gloo")
print(f"ready rank {dist.get_rank()}", flush=True)
while True:
    time.sleep(1)
