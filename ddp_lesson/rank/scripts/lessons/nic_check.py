"""Which address does each rank's gloo listen on, and can the others reach it?

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --rdzv-backend c10d \
             --rdzv-endpoint node0:29400 nic_check.py

Every rank joins the group and all-reduces a 1. The group gets a short timeout (--timeout,
seconds), so a rank that cannot reach another fails in seconds instead of the default
30 minutes of waiting.
"""
import argparse
import datetime
import os
import socket

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_lesson.rank import metrics


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--timeout", type=float, default=20, help="seconds to wait for the other ranks")
    args = p.parse_args()
    host = socket.gethostname()
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    # Without GLOO_SOCKET_IFNAME gloo listens on an address this machine's own name resolves to
    # (loopback if none is local).
    # getaddrinfo, as gloo does; gethostbyname would show only the first IPv4 address
    resolved = sorted({a[4][0] for a in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)})
    where = f"interface {ifname}" if ifname else f"{', '.join(resolved)} (what {host} resolves to here)"
    print(f"{host}: gloo listens on {where}", flush=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    x = torch.ones(1)
    dist.all_reduce(x)  # every rank ends with the world size
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} on {host}: all_reduce gave {x.item():g}",
          flush=True)
    metrics.log(0, all_reduce=x.item(), world_size=dist.get_world_size(), host=host)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
