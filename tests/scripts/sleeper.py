"""Two ranks join a gloo process group, say "ready" and then sleep until they are ended."""
import time

import torch.distributed as dist

dist.init_process_group("gloo")
print(f"ready rank {dist.get_rank()}", flush=True)
while True:
    time.sleep(1)
