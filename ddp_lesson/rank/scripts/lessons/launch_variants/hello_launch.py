"""torch.distributed.launch (deprecated: it warns since PyTorch 1.9, torchrun replaced it in 1.10;
torch/distributed/launch.py still warns "The module torch.distributed.launch is deprecated"
in 2.14, then runs torchrun underneath). It always sets LOCAL_RANK, as torchrun does.
Without --use-env it also passes the local rank as a command-line argument (--local-rank,
once --local_rank), which the script must then parse; --use-env (older spelling --use_env)
drops that argument.
    python -m torch.distributed.launch --nproc-per-node 2 hello_launch.py          # argument
    python -m torch.distributed.launch --nproc-per-node 2 --use-env hello_launch.py  # environment
"""
import argparse
import os

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--local-rank", "--local_rank", type=int, default=None)  # both spellings existed
args = p.parse_args()
local_rank = args.local_rank if args.local_rank is not None else int(os.environ["LOCAL_RANK"])
how = "argument" if args.local_rank is not None else "environment"

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"launch: rank {dist.get_rank()} local_rank {local_rank} (from the {how}) sum {t.item():.0f}", flush=True)
dist.destroy_process_group()
